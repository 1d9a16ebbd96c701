"""Every bad-input reproduction of repro_2026-12-01 (D1-D9, D18) answers a 4xx naming the field, never a 5xx.

The bodies are the repro file's, sent to servers on `FakeOmni`, so what is pinned is the HTTP layer's own
validation: all of it happens before anything is queued (the fake engine records every request it sees).
"""

from __future__ import annotations

import base64
import json

import pytest

from tests.reliability.conftest import assert_client_error

BIG = "1" * 5000
CHAT = [{"role": "user", "content": "a"}]
J = {"content-type": "application/json"}


def post_raw(client, path: str, body: str):
    """Raw JSON text: lone surrogates as escapes, NaN / Infinity literals, exactly as the repro sent them."""
    return client.post(path, content=body.encode(), headers=J)


# D1 (size passes isdigit but not int), D2 (width of 5000 digits), D3 (seed out of int64/uint64), D9 (seconds).
@pytest.mark.parametrize("server,path,body,param", [
    ("img", "/v1/images/generations", {"prompt": "a", "size": "²x²"}, "size"),
    ("img", "/v1/chat/completions", {"messages": CHAT, "size": "²x²"}, "size"),
    ("img", "/v1/chat/completions", {"messages": CHAT, "size": "²x²", "stream": True}, "size"),
    ("img", "/v1/chat/completions/batch", {"messages": [CHAT], "size": "²x²"}, "size"),
    ("vid", "/v1/videos", {"prompt": "a", "size": "²x²"}, "size"),
    ("vid", "/v1/videos/sync", {"prompt": "a", "size": "²x²"}, "size"),
    ("img", "/v1/images/generations", {"prompt": "a", "size": f"{BIG}x64"}, "size"),
    ("img", "/v1/chat/completions", {"messages": CHAT, "size": f"{BIG}x64"}, "size"),
    ("vid", "/v1/videos", {"prompt": "a", "size": f"{BIG}x64"}, "size"),
    ("img", "/v1/images/generations", {"prompt": "a", "size": "64x64", "num_inference_steps": 2,
                                       "seed": 18446744073709551616}, "seed"),
    ("img", "/v1/images/generations", {"prompt": "a", "seed": -9223372036854775809}, "seed"),
    ("vid", "/v1/videos/sync", {"prompt": "a", "seed": 18446744073709551616}, "seed"),
    ("vid", "/v1/videos", {"prompt": "a", "seed": 18446744073709551616}, "seed"),
    ("vid", "/v1/videos/sync", {"prompt": "a", "size": "64x64", "num_inference_steps": 2, "seconds": 1e300},
     "seconds"),
    ("vid", "/v1/videos", {"prompt": "a", "size": "64x64", "num_inference_steps": 2, "seconds": 1e300}, "seconds"),
])
def test_numbers_and_sizes(request, server, path, body, param):
    assert_client_error(request.getfixturevalue(server).post(path, json=body), param)


@pytest.mark.parametrize("server,path,body,param", [
    # D9: Infinity passes pydantic's gt=0. D18: NaN / Infinity guidance reached the pipeline.
    ("vid", "/v1/videos", '{"prompt":"a","size":"64x64","num_inference_steps":2,"seconds":Infinity}', "seconds"),
    ("vid", "/v1/videos/sync", '{"prompt":"a","seconds":Infinity}', "seconds"),
    ("img", "/v1/images/generations", '{"prompt":"a","guidance_scale":NaN}', "guidance_scale"),
    ("img", "/v1/chat/completions", '{"messages":[{"role":"user","content":"a"}],"true_cfg_scale":Infinity}',
     "true_cfg_scale"),
    ("ar", "/v1/chat/completions", '{"messages":[{"role":"user","content":"a"}],"temperature":NaN}', "temperature"),
    ("ar", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"a"}],"sampling_params_list":[{"temperature":NaN}]}',
     "sampling_params_list[0].temperature"),
    # D5: a lone surrogate in chat content (AR and diffusion chat), prompts and negative prompts.
    ("img", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"\\ud800"}],"size":"64x64","num_inference_steps":2}',
     "messages[0].content"),
    ("ar", "/v1/chat/completions", '{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":8}',
     "messages[0].content"),
    ("ar", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}', "messages[0].content[0].text"),
    ("img", "/v1/images/generations", '{"prompt":"\\ud800"}', "prompt"),
    ("vid", "/v1/videos", '{"prompt":"a","negative_prompt":"\\ud800"}', "negative_prompt"),
])
def test_non_finite_numbers_and_unencodable_text(request, server, path, body, param):
    assert_client_error(post_raw(request.getfixturevalue(server), path, body), param)


# D6: messages null and harmony-style messages (found by schemathesis); D18: any role.
@pytest.mark.parametrize("server,path,body,param", [
    ("img", "/v1/chat/completions", {"messages": None}, "messages"),
    ("ar", "/v1/chat/completions", {"messages": None}, "messages"),
    ("img", "/v1/chat/completions", {"messages": [{"author": {"role": "user"}, "content": []}]}, "messages[0].role"),
    ("img", "/v1/chat/completions/batch", {"messages": [[{"author": {"role": "user"}, "content": []}]]},
     "messages[0][0].role"),
    ("ar", "/v1/chat/completions", {"messages": [{"role": "hacker", "content": "hi"}]}, "messages[0].role"),
    ("ar", "/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("ar", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("img", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
])
def test_message_shapes(request, server, path, body, param):
    assert_client_error(request.getfixturevalue(server).post(path, json=body), param)


# The 2026-12-02 sweep (every schema field of every route set to hostile values): what still named vLLM's
# pydantic union path, answered 500, or named no field.
@pytest.mark.parametrize("server,body,param", [
    ("ar", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ("img", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ("ar", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "messages[0].content[1]"),
    ("ar", {"messages": CHAT, "structured_outputs": "x"}, "structured_outputs"),  # was 500 AttributeError
    ("img", {"messages": CHAT, "structured_outputs": []}, "structured_outputs"),
    ("ar", {"messages": CHAT, "structured_outputs": {}}, "structured_outputs"),
    ("ar", {"messages": CHAT, "min_p": 1.5}, "min_p"),
    ("ar", {"messages": CHAT, "stop": ""}, "stop"),
])
def test_sweep_findings(request, server, body, param):
    err = assert_client_error(request.getfixturevalue(server).post("/v1/chat/completions", json=body), param)
    assert "ContentPart" not in err["message"], err  # no pydantic union member names


def test_empty_body_says_so(img):
    resp = img.post("/v1/images/generations", content=b"", headers=J)
    assert resp.status_code == 400 and "request body is missing" in resp.json()["error"]["message"], resp.text


# D18: fields that mean nothing to a model without an AR stage are refused by name, not ignored.
@pytest.mark.parametrize("extra,param", [
    ({"n": -1}, "n"), ({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"chat_template": "{{ bad"}, "chat_template"),
])
def test_text_generation_fields_on_a_diffusion_model(img, extra, param):
    assert_client_error(img.post("/v1/chat/completions", json={"messages": CHAT, **extra}), param)
    if param != "n":  # batch chat has its own n rule
        assert_client_error(img.post("/v1/chat/completions/batch", json={"messages": [CHAT], **extra}), param)


@pytest.mark.parametrize("body,param", [
    # D18: sampling_params_list bypassed --max-request-outputs (n=1000 gave 200 and one empty choice).
    ({"messages": [{"role": "user", "content": "hi"}], "sampling_params_list": [{"max_tokens": 4, "n": 1000}]},
     "sampling_params_list[0].n"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "max_tokens": 10**30}, "max_tokens"),
])
def test_ar_sampling_bounds(ar, body, param):
    assert_client_error(ar.post("/v1/chat/completions", json=body), param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "num_inference_steps": 1000000}, "num_inference_steps"),  # D10a's request: bounded
    ({"prompt": "a", "size": "8192x8192"}, "width"),
    ({"messages": CHAT, "num_inference_steps": 1000000}, "num_inference_steps"),
])
def test_diffusion_bounds(img, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/images/generations"
    err = assert_client_error(img.post(path, json=body), param)
    assert "--max-" in err["message"]  # the message names the server flag that sets the bound


def test_video_bounds_and_late_validation(vid):
    """D18: POST /v1/videos validated late (200 queued, then failed); now the job is never created."""
    engine = vid.app.state.engine
    seen = len(engine.seen)
    assert_client_error(vid.post("/v1/videos", json={"prompt": "a", "num_frames": 100000}), "num_frames")
    assert_client_error(vid.post("/v1/videos", json={"prompt": "a", "seconds": 3600}), "seconds")
    assert_client_error(vid.post("/v1/videos", json={"prompt": "a", "fps": 10**6}), "fps")
    assert len(engine.seen) == seen
    assert vid.get("/v1/videos").json()["data"] == []


# Multipart forms: the same checks after the string -> number coercion (D1, D3 on /v1/images/edits).
@pytest.mark.parametrize("fields,param", [
    ({"prompt": "x", "size": "²x²"}, "size"),
    ({"prompt": "x", "seed": "18446744073709551616"}, "seed"),
    ({"prompt": "x", "num_inference_steps": "1" * 5000}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": "nan"}, "guidance_scale"),
])
def test_edit_form_fields(img, fields, param):
    files = {"image": ("ok.png", _ok_png())}
    assert_client_error(img.post("/v1/images/edits", data=fields, files=files), param)


@pytest.mark.parametrize("fields,param", [
    ({"prompt": "x", "seed": "18446744073709551616"}, "seed"),
    ({"prompt": "x", "seconds": "inf"}, "seconds"),
    ({"prompt": "x", "size": "²x²"}, "size"),
])
def test_video_form_fields(vid, fields, param):
    assert_client_error(vid.post("/v1/videos", data=fields), param)


# D4: decompression bombs, as upload, data URL in chat and input_reference (JSON and multipart).
def test_decompression_bomb(img, vid, bomb_error):
    files = {"image": ("bomb.png", bomb_error)}
    assert_client_error(img.post("/v1/images/edits", data={"prompt": "x", "size": "64x64"}, files=files), "image")
    url = "data:image/png;base64," + base64.b64encode(bomb_error).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    assert_client_error(img.post("/v1/chat/completions", json=chat), "messages[0].content")
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert_client_error(vid.post(path, json={"prompt": "a", "input_reference": url}), "input_reference")
        assert_client_error(vid.post(path, data={"prompt": "a"}, files={"input_reference": ("b.png", bomb_error)}),
                            "input_reference")


# D8: nested JSON on the videos routes (the other routes already answered 400).
@pytest.mark.parametrize("path", ["/v1/videos", "/v1/videos/sync", "/v1/images/generations",
                                  "/v1/chat/completions"])
def test_deeply_nested_json(request, path):
    client = request.getfixturevalue("vid" if "videos" in path else "img")
    nested = '{"x": ' + "[" * 100000 + "]" * 100000 + "}"
    resp = post_raw(client, path, nested)
    assert 400 <= resp.status_code < 500 and resp.json()["error"]["code"] == resp.status_code, resp.text
    shallow = '{"prompt": "a", "input_reference": {"image_url": ' + "[" * 100 + "]" * 100 + "}}"
    if "videos" in path:
        assert_client_error(post_raw(client, path, shallow), "input_reference.image_url" + "[0]" * 63)


def _ok_png() -> bytes:
    from tests.reliability.conftest import png

    return png((64, 64), "RGB")


def test_websocket_bad_input(vid):
    """D1/D3 over the socket are `error` messages naming the field (were internal_error / engine_error); a
    binary first frame (was KeyError) gets an error message and close code 1003, a 100k-deep JSON text
    message (was RecursionError) an invalid_json error, and the socket stays usable."""
    with vid.websocket_connect("/v1/realtime/video") as ws:
        ws.send_text("[" * 100000 + "]" * 100000)
        assert ws.receive_json()["code"] == "invalid_json"
        for params, param in (({"size": "²x²"}, "size"), ({"seed": 18446744073709551616}, "seed"),
                              ({"seconds": 1e300}, "seconds")):
            ws.send_text(json.dumps({"type": "session.start", "prompt": "a", "sampling_params": params}))
            msg = ws.receive_json()
            assert (msg["type"], msg["code"], msg["param"]) == ("error", "invalid_request", param), msg
        ws.send_text('{"type": "session.start", "prompt": "\\ud800"}')
        assert ws.receive_json()["param"] == "prompt"
    with vid.websocket_connect("/v1/realtime/video") as ws:
        ws.send_bytes(b"\x00\x01")
        msg = ws.receive_json()
        assert (msg["type"], msg["code"]) == ("error", "unsupported_data")
        assert ws.receive()["code"] == 1003


def test_websocket_sweep_findings(vid):
    """The WebSocket sweep: an empty-list `sampling_params` ran a default-size video (it read as absent), and an
    unknown message type named no field."""
    with vid.websocket_connect("/v1/realtime/video") as ws:
        ws.send_text(json.dumps({"type": "session.start", "prompt": "a", "sampling_params": []}))
        msg = ws.receive_json()
        assert (msg["type"], msg["code"], msg["param"]) == ("error", "invalid_request", "sampling_params"), msg
        ws.send_text('{"type": "bogus"}')
        msg = ws.receive_json()
        assert (msg["code"], msg["param"]) == ("unknown_type", "type"), msg
