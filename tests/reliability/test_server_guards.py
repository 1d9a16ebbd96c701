"""Server-wide guards of repro_2026-12-01: body size (D11), event-loop stalls (D12), input-image pixels (D13),
sleep (D14), cross-origin state changes (D15) and streams to a dead engine (D19), on `FakeOmni` servers."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest
from starlette.websockets import WebSocketDisconnect

from tests.entrypoints.openai.fake_engine import FakeOmni, _Tokenizer
from tests.reliability.conftest import assert_client_error, make_client, png

CHAT = [{"role": "user", "content": "hi"}]
EVIL = {"origin": "http://evil.example"}


def test_request_body_limit(parser):
    """D11: a 50 MB prompt was accepted (110 s, worker at 10.8 GB); now 413 before the body is read."""
    client = make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"image"},
                                          input_modalities={"text", "image"}),
                         "--max-request-body-mb", "1", "--max-upload-mb", "2")
    body = {"prompt": "a" * (2 * 2**20), "size": "64x64", "num_inference_steps": 2}
    err = assert_client_error(client.post("/v1/images/generations", json=body), "body", status=413)
    assert "--max-request-body-mb" in err["message"]

    def chunked():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(3):
            yield b"a" * 2**19
        yield b'"}'

    resp = client.post("/v1/images/generations", content=chunked(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    # Multipart uploads keep their own, larger limit; small bodies pass.
    ok = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", png((64, 64), "RGB"))})
    assert ok.status_code == 200, ok.text
    assert client.post("/v1/images/generations", json={"prompt": "a"}).status_code == 200


def test_input_image_pixels_checked_from_header(parser, bomb_warn):
    """D13: a 17.5 KB PNG of 144 Mpx was decoded to RGB (API RSS +1.3 GB); the header now decides (and a
    text-to-image model refuses input images before reading them at all)."""
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"}, input_modalities={"text", "image"})
    client = make_client(parser, engine, "--max-input-image-pixels", "1000000")
    seen = len(engine.seen)
    err = assert_client_error(client.post("/v1/images/edits", data={"prompt": "x", "size": "64x64"},
                                          files={"image": ("bomb.png", bomb_warn)}), "image")
    assert "12000x12000" in err["message"] and "--max-input-image-pixels" in err["message"]
    url = "data:image/png;base64," + base64.b64encode(png((1001, 1000), "RGB")).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    assert_client_error(client.post("/v1/chat/completions", json=chat), "messages[0].content")
    assert len(engine.seen) == seen


def test_input_images_refused_by_text_only_model(parser):
    """D13: a text-to-image model got (and ignored) the decoded image; it is refused before decoding."""
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"})
    engine.input_modalities = frozenset({"text"})
    client = make_client(parser, engine)
    resp = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", png((8, 8), "RGB"))})
    assert_client_error(resp, "image")


class _SlowTokenizer(_Tokenizer):
    """Templating that holds the GIL-free CPU for 0.5 s (time.sleep stands for a heavy render/tokenize)."""

    def apply_chat_template(self, messages, **kwargs) -> str:
        time.sleep(0.5)
        return super().apply_chat_template(messages, **kwargs)


async def test_health_answers_while_a_request_is_prepared(parser):
    """D12: /health took 3.8-9.9 s while one request's template was rendered / tokenized in the event loop."""
    engine = FakeOmni(stage_types=["llm"], output_modalities={"text"})
    engine.get_tokenizer = _SlowTokenizer
    app = make_client(parser, engine).app
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        await client.get("/health")  # warm-up: first-call imports are not what is measured
        request = asyncio.create_task(client.post("/v1/chat/completions",
                                                  json={"messages": CHAT, "max_tokens": 2}))
        await asyncio.sleep(0.05)
        latencies = []
        while not request.done():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        assert (await request).status_code == 200
    assert len(latencies) >= 3 and max(latencies) < 0.1, latencies


def test_request_chat_template_needs_trust(parser, ar):
    """D12: a request template rendered 400M loop iterations; vLLM's --trust-request-chat-template gates it."""
    body = {"messages": CHAT, "max_tokens": 2, "chat_template": "{% for i in range(20000) %}{% endfor %}hi"}
    err = assert_client_error(ar.post("/v1/chat/completions", json=body), "chat_template")
    assert "--trust-request-chat-template" in err["message"]
    kwargs_body = {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}
    assert_client_error(ar.post("/v1/chat/completions", json=kwargs_body), "chat_template")
    trusted = make_client(parser, FakeOmni(stage_types=["llm"], output_modalities={"text"}),
                          "--trust-request-chat-template")
    assert trusted.post("/v1/chat/completions", json=body).status_code == 200


def test_sleeping_server(parser):
    """D14: /health said 200 and requests hung while asleep. /health stays 200 as vLLM's does (a liveness probe
    must not restart a server put to sleep on purpose) with a body that says so; requests get 503 at once."""
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"})
    client = make_client(parser, engine)
    assert client.post("/v1/omni/sleep", json={"level": 1}).status_code == 200
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "sleeping", "is_sleeping": True}
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    start = time.perf_counter()
    resp = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64"})
    assert resp.status_code == 503 and "wakeup" in resp.json()["error"]["message"]
    assert time.perf_counter() - start < 1.0
    stream = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert stream.status_code == 503
    assert client.post("/v1/omni/wakeup", json={}).status_code == 200
    assert client.get("/health").content == b"" and client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64"}).status_code == 200


@pytest.mark.parametrize("path,kwargs,status", [
    ("/v1/omni/sleep", {}, 400),  # a body-less POST is a CORS "simple request"
    ("/v1/omni/wakeup", {"content": b"{}", "headers": {"content-type": "text/plain"}}, 400),
    ("/v1/videos", {"content": b'{"prompt":"csrf","size":"64x64","num_frames":5,"num_inference_steps":2}',
                    "headers": {"content-type": "text/plain"}}, 415),
])
def test_state_changing_posts_need_json(vid, path, kwargs, status):
    """D15: a foreign page could put the server to sleep or create jobs with simple requests."""
    resp = vid.post(path, **kwargs)
    assert resp.status_code == status and resp.json()["error"]["code"] == status, resp.text
    assert vid.app.state.engine.calls == [] and vid.get("/v1/videos").json()["data"] == []


def test_cross_origin_guard(parser, vid):
    """D15: Origin: http://evil.example could drive the WebSocket and send form POSTs (CORS only hides the
    answer). Same-origin, non-browser (no Origin) and --allowed-origins clients keep working."""
    with pytest.raises(WebSocketDisconnect) as refused, \
            vid.websocket_connect("/v1/realtime/video", headers=EVIL) as ws:
        ws.receive_json()
    assert refused.value.code == 1008
    form = vid.post("/v1/videos", data={"prompt": "csrf"}, headers=EVIL)
    assert_client_error(form, "origin", status=403)
    assert vid.post("/v1/omni/sleep", json={}, headers=EVIL).status_code == 403
    assert vid.app.state.engine.calls == []
    assert vid.get("/v1/models", headers=EVIL).status_code == 200  # reads are CORS's business
    for headers in ({}, {"origin": "http://testserver"}):
        with vid.websocket_connect("/v1/realtime/video", headers=headers) as ws:
            ws.send_json({"type": "session.ping"})
            assert ws.receive_json() == {"type": "session.pong"}
    allowed = make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"video"}),
                          "--allowed-origins", '["http://evil.example"]')
    with allowed.websocket_connect("/v1/realtime/video", headers=EVIL) as ws:
        ws.send_json({"type": "session.ping"})
        assert ws.receive_json() == {"type": "session.pong"}


def test_stream_to_dead_engine_is_503(parser):
    """D19: stream=true to a dead engine answered HTTP 200 (role chunk, error event, [DONE])."""
    engine = FakeOmni(stage_types=["llm"], output_modalities={"text"})
    client = make_client(parser, engine)
    engine.is_dead = True
    resp = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailableError"


async def test_engine_dying_mid_stream_ends_with_error_event(parser):
    """Once chunks were sent, a failure can only be reported in-band: an error event, then [DONE]."""
    engine = FakeOmni(stage_types=["llm"], output_modalities={"text"})
    original = engine.generate

    async def dies_after_one(*args, **kwargs):
        from vllm_omni.errors import EngineDeadError

        async for out in original(*args, **kwargs):
            yield out
            raise EngineDeadError()

    engine.generate = dies_after_one
    client = make_client(parser, engine)
    resp = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "max_tokens": 4})
    assert resp.status_code == 200
    events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"code":503' in events[-2]


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(parser):
    """D12: a 5 MB prompt was tokenized (seconds of GIL-holding work) only for vLLM to refuse it; the bound
    vLLM itself applies first (max_model_len x the tokenizer's longest token) now runs before tokenizing."""

    class _Tok(_Tokenizer):
        max_chars_per_token = 4

        def encode(self, text, add_special_tokens=False):
            raise AssertionError("a prompt that cannot fit was tokenized")

    engine = FakeOmni(stage_types=["llm"], output_modalities={"text"})
    engine.get_tokenizer = _Tok
    engine.model_config = type("ModelConfig", (), {"max_model_len": 512})()
    client = make_client(parser, engine)
    body = {"messages": [{"role": "user", "content": "a " * 2048}], "max_tokens": 2}
    err = assert_client_error(client.post("/v1/chat/completions", json=body), "messages")
    assert "2048" in err["message"] and "--max-model-len" in err["message"]
