"""The HTTP layer's own contract, isolated from the engine with `FakeOmni` (contract 4 shapes).

What it pins: OpenAI-compatible bodies for every route (through the official `openai` client), per-stage
sampling params built from request fields, 4xx (never 5xx) with an error body naming the problem for bad
input, and that leaving a request early aborts it in the engine. The live tests run the real engine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.entrypoints.openai.fake_engine import FakeOmni
from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser
from vllm_omni.entrypoints.openai.api_server import build_app

CHAT = [{"role": "user", "content": "draw a cat"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def parser():
    return make_omni_arg_parser(FlexibleArgumentParser())


def make_client(parser, engine: FakeOmni, *extra: str) -> TestClient:
    args = parser.parse_args(["fake-model", "--max-upload-mb", "1", *extra])
    args.model = args.model_tag
    return TestClient(build_app(args, engine), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def ar(parser):
    engine = FakeOmni(stage_types=["llm", "generation"], output_modalities={"text", "audio"})
    return engine, make_client(parser, engine)


@pytest.fixture(scope="module")
def dit(parser):
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"}, input_modalities={"text", "image"})
    return engine, make_client(parser, engine)


def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def assert_error(resp, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    for needle in needles:
        assert needle in err["message"], err
    return err


def test_chat_text_and_audio(ar):
    engine, client = ar
    out = oai(client).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=5,
                                              modalities=["text", "audio"], audio={"voice": "a", "format": "wav"})
    msg = out.choices[0].message
    assert msg.content == "w0 w1 w2 w3 w4"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.id.startswith("chatcmpl-")
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() == 2400
    assert msg.audio.transcript == msg.content
    prompt, request_id, params = engine.seen[-1]
    assert prompt == {"prompt": "<user>draw a cat<assistant>", "voice": "a"} and request_id == out.id
    assert params[0].max_tokens == 5  # the request's fields reach the AR stage only


def test_speech(ar):
    engine, client = ar
    audio = oai(client).audio.speech.create(model="fake-model", input="hello there", voice="alloy",
                                            response_format="wav")
    with wave.open(io.BytesIO(audio.read())) as wav:
        assert wav.getframerate() == 24000 and wav.getsampwidth() == 2 and wav.getnframes() == 2400
    # An AR-first pipeline answers `input` as a chat user turn.
    assert engine.seen[-1][0] == {"prompt": "<user>hello there<assistant>", "voice": "alloy"}
    pcm = client.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm"})
    assert pcm.headers["content-type"] == "audio/pcm" and len(pcm.content) == 2400 * 2


def test_speech_seed_reaches_every_sampling_stage(parser):
    """`seed` on /v1/audio/speech is each sampling stage's seed (two AR stages here, as Qwen3-Omni's thinker and
    talker); a request without one samples unseeded."""
    engine = FakeOmni(stage_types=["llm", "llm", "generation"], output_modalities={"audio"})
    client = make_client(parser, engine)
    assert client.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm", "seed": 7}).status_code \
        == 200
    seeded = engine.seen[-1][2]
    assert [p.seed for p in seeded[:2]] == [7, 7]
    assert client.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm"}).status_code == 200
    assert [p.seed for p in engine.seen[-1][2][:2]] == [None, None]
    assert client.post("/v1/audio/speech", json={"input": "hi", "seed": -1}).json()["error"]["param"] == "seed"


def test_api_key_guards_v1_routes_only(parser):
    client = make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"image"}),
                         "--api-key", "sekret")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_chat_text_only_modality_drops_audio(ar):
    _, client = ar
    out = oai(client).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=2, modalities=["text"])
    assert out.choices[0].message.audio is None and out.choices[0].message.content == "w0 w1"


def test_chat_stream(ar):
    _, client = ar
    stream = oai(client).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, modalities=["text"])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_batch_chat(ar):
    engine, client = ar
    body = {"model": "fake-model", "messages": [CHAT, [{"role": "user", "content": "b"}]], "max_tokens": 3,
            "modalities": ["text"], "stream": True}
    resp = client.post("/v1/chat/completions/batch", json=body, headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["id"] == "chatcmpl-batch-abc"
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 6
    ids = {rid for _, rid, _ in engine.seen[-2:]}
    assert ids == {"abc-idx-0", "abc-idx-1"}


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/chat/completions", {"size": "64x64"}, "size"),
    ("/v1/chat/completions", {"num_inference_steps": 4, "quality": "fast"}, "num_inference_steps"),
    ("/v1/chat/completions", {"priority": -1}, "priority"),
    ("/v1/chat/completions/batch", {"guidance_scale": 3.0}, "guidance_scale"),
])
def test_chat_refuses_what_no_stage_takes(ar, path, extra, field):
    """A pipeline without a diffusion stage (tiny/qwen2, Qwen3-Omni) would drop the diffusion fields and a
    priority (the AR stage is not given one): refused, named (docs/serving.md); vLLM's default priority 0 passes."""
    _, client = ar
    messages = [CHAT] if path.endswith("batch") else CHAT
    err = assert_error(client.post(path, json={"messages": messages, "modalities": ["text"], **extra}), 400,
                       "no diffusion stage")
    assert err["param"] == field
    assert client.post(path, json={"messages": messages, "modalities": ["text"], "max_tokens": 1,
                                   "priority": 0}).status_code == 200


def test_images_user_is_logged_with_the_request(dit, caplog):
    engine, client = dit
    with caplog.at_level("INFO", logger="vllm_omni.entrypoints.openai.serving_base"):
        assert client.post("/v1/images/generations", json={"prompt": "x", "user": "alice-42"}).status_code == 200
    request_id = engine.seen[-1][1]
    assert f"request {request_id}: user 'alice-42'" in [r.getMessage() for r in caplog.records]


def test_images_generate_and_chat_image(dit):
    engine, client = dit
    res = oai(client).images.generate(prompt="a cat", n=2, size="64x48",
                                      extra_body={"num_inference_steps": 3, "seed": 7, "negative_prompt": "dog"})
    assert len(res.data) == 2
    img = Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json)))
    assert img.size == (64, 48)
    prompt, _, params = engine.seen[-1]
    sp = params[0]
    assert (sp.width, sp.height, sp.num_inference_steps, sp.seed, sp.num_outputs_per_prompt) == (64, 48, 3, 7, 2)
    assert prompt == {"prompt": "a cat", "negative_prompt": "dog"}

    out = oai(client).chat.completions.create(model="fake-model", messages=CHAT,
                                              extra_body={"size": "32x32", "quality": "high", "cfg_scale": 3.0})
    parts = out.choices[0].message.content
    assert parts[0]["type"] == "image_url" and parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    sp = engine.seen[-1][2][0]
    assert (sp.quality, sp.true_cfg_scale, sp.num_inference_steps) == ("high", 3.0, 4)  # default steps kept


def test_chat_input_image_reaches_diffusion_stage(dit):
    engine, client = dit
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (0, 0, 255)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    oai(client).chat.completions.create(model="fake-model", extra_body={"negative_prompt": "red"}, messages=[
        {"role": "system", "content": "ignored by diffusion"},
        {"role": "user", "content": [{"type": "text", "text": "make it"}, {"type": "text", "text": "green"},
                                     {"type": "image_url", "image_url": {"url": url}}]}])
    prompt = engine.seen[-1][0]
    assert prompt["prompt"] == "make it\ngreen" and prompt["negative_prompt"] == "red"
    assert prompt["multi_modal_data"]["image"].size == (8, 6)


def test_stream_error_is_an_sse_error_event(dit):
    _, client = dit
    body = {"messages": CHAT, "stream": True, "size": "13x16"}  # the fake pipeline rejects width 13
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and "multiple of 16" in error["message"]


def test_images_edit_multipart(dit):
    engine, client = dit
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 255, 0)).save(buf, format="PNG")
    res = oai(client).images.edit(image=("in.png", buf.getvalue(), "image/png"), prompt="make it red", size="32x32")
    assert len(res.data) == 1
    prompt = engine.seen[-1][0]
    assert prompt["prompt"] == "make it red" and prompt["multi_modal_data"]["image"].size == (16, 16)


def test_models_health_metrics_sleep(dit):
    engine, client = dit
    assert [m.id for m in oai(client).models.list()] == ["fake-model"]
    assert client.get("/health").status_code == 200
    resp = client.post("/v1/omni/sleep", json={"level": 1})
    assert resp.status_code == 200 and resp.json()["acks"][0]["status"] == "SUCCESS"
    assert client.post("/v1/omni/wakeup", json={"tags": ["weights"]}).status_code == 200
    assert [c[0] for c in engine.calls[-3:]] == ["sleep", "wake_up", "resume_generation"]
    metrics = client.get("/metrics").text
    assert 'vllm_omni:http_requests_total{model_name="fake-model",route="/v1/images/generations"' in metrics
    assert "vllm_omni:stage_duration_seconds_bucket" in metrics and "diffusion.denoise" in metrics
    engine.is_dead = True
    try:
        assert_error(client.get("/health"), 503, "dead")
        assert_error(client.post("/v1/images/generations", json={"prompt": "x"}), 503)
    finally:
        engine.is_dead = False


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "fake-model"}, 400, "missing required field 'messages'"),
        ("/v1/chat/completions", {"messages": CHAT, "model": "other"}, 404, "other"),
        ("/v1/chat/completions", {"messages": CHAT, "modalities": ["image"]}, 400, "modalities"),
        ("/v1/chat/completions", {"messages": CHAT, "sampling_params_list": [{}]}, 400, "one entry per stage"),
        ("/v1/chat/completions", {"messages": CHAT, "sampling_params_list": [{"max_tokens": -1}, {}]}, 400,
         "sampling_params_list[0]"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL]}, 400, "modalities=['text']"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "modalities": ["text"]}, 400,
         "--enable-auto-tool-choice"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": "required",
                                  "modalities": ["text"]}, 400, "--tool-call-parser"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "text-only answer"),  # this model also speaks
        ("/v1/chat/completions", {"messages": CHAT, "n": 99, "modalities": ["text"]}, 400, "max-request-outputs"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "modalities": ["text"], "tools": [TOOL]}, 400,
         "tool calling"),
        ("/v1/chat/completions/batch", {"messages": [CHAT], "n": 2}, 400, "n"),
        ("/v1/chat/completions/batch", {"messages": []}, 400, "messages"),
        ("/v1/images/generations", {"prompt": "x"}, 400, "outputs image"),
        ("/v1/audio/speech", {"input": "hi", "response_format": "mp4"}, 400, "response_format"),
        ("/v1/omni/sleep", {"level": 3}, 400, "level"),
    ],
)
def test_bad_requests_ar(ar, path, body, status, needle):
    _, client = ar
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    assert_error(client.post(path, **kwargs), status, needle)


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/images/generations", {"prompt": "x", "size": "big"}, 400, "size"),
        ("/v1/images/generations", {"prompt": "x", "size": "0x64"}, 400, "size"),
        ("/v1/images/generations", {"prompt": "x", "size": "100000x64"}, 400, "width"),
        ("/v1/images/generations", {"prompt": "x", "n": 99}, 400, "max-request-outputs"),
        ("/v1/images/generations", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/images/generations", {"prompt": ""}, 400, "prompt"),
        ("/v1/images/generations", {"prompt": "x", "quality": "ultra"}, 400, "quality"),
        ("/v1/images/generations", {"prompt": "x", "background": "transparent"}, 400, "background"),
        ("/v1/images/generations", {"prompt": "x", "output_compression": 50}, 400, "png is lossless"),
        ("/v1/images/generations", {"prompt": "x", "n": 2, "num_outputs_per_prompt": 3}, 400, "disagree"),
        ("/v1/images/generations", {"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
        ("/v1/images/generations", {"prompt": "x", "guidance_scale": "hi"}, 400, "guidance_scale"),
        ("/v1/images/generations", {"prompt": "x", "size": "13x16"}, 400, "multiple of 16"),  # pipeline error
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}, 400, "user message"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, {"type": "text", "text": "x"}]}]},
         400, "data: URL"),
        ("/v1/audio/speech", {"input": "hi"}, 400, "outputs audio"),
        ("/v1/nope", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_diffusion(dit, path, body, status, needle):
    _, client = dit
    assert_error(client.post(path, json=body), status, needle)


@pytest.mark.parametrize("fixture,path,body,field", [
    ("ar", "/v1/chat/completions", {"messages": CHAT, "store": True, "metadata": {"k": "v"}}, "metadata"),
    ("dit", "/v1/images/generations", {"prompt": "x", "styel": "vivid"}, "styel"),
])
def test_unknown_fields_ignored_with_a_warning_or_refused_when_strict(parser, request, caplog, fixture, path, body,
                                                                       field):
    """vLLM's policy: an unknown field is ignored and logged; --strict-request-fields refuses it, named."""
    engine, client = request.getfixturevalue(fixture)
    assert client.post(path, json=body).status_code == 200
    assert any(field in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert_error(make_client(parser, engine, "--strict-request-fields").post(path, json=body), 400, field)


def test_every_4xx_is_logged_with_its_reason(dit, caplog):
    _, client = dit
    with caplog.at_level("INFO", logger="vllm_omni.entrypoints.openai.middleware"):
        client.post("/v1/images/generations", json={"prompt": "x", "size": "big"})
        client.post("/v1/nope", json={})
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("middleware")]
    assert any("POST /v1/images/generations -> 400:" in line and "[param=size]" in line for line in lines)
    assert any("POST /v1/nope -> 404: Not Found" in line for line in lines)


def test_openai_image_values(dit):
    """OpenAI's quality values map to our presets, num_outputs_per_prompt alone sets the count, and
    output_compression reaches the jpeg encoder."""
    engine, client = dit
    for quality, preset in (("standard", None), ("hd", "lossless"), ("medium", "high"), ("auto", None)):
        assert client.post("/v1/images/generations", json={"prompt": "x", "quality": quality}).status_code == 200
        assert engine.seen[-1][2][0].quality == preset
    resp = client.post("/v1/images/generations", json={"prompt": "x", "num_outputs_per_prompt": 2})
    assert resp.status_code == 200 and len(resp.json()["data"]) == 2
    sizes = [len(client.post("/v1/images/generations", json={
        "prompt": "x", "output_format": "jpeg", "output_compression": c, "background": "opaque"}).json()["data"][0][
        "b64_json"]) for c in (0, 95)]
    assert sizes[0] > sizes[1]


def test_bad_edits(dit):
    _, client = dit
    assert_error(client.post("/v1/images/edits", data={"prompt": "x"}), 400, "image is required")
    assert_error(client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", b"notanimage")}),
                 400, "not a readable image")
    big = b"\0" * (2 * 2**20 + 10)
    assert_error(client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", big)}), 413)
    assert_error(client.post("/v1/images/edits", data={"prompt": "x", "n": "two"},
                             files={"image": ("a.png", b"x")}), 400, "n must be a number")
    assert_error(client.get("/v1/images/edits"), 405)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("stage_types,inputs,outputs", [
    (["diffusion"], {"text"}, {"image"}),  # text-to-image
    (["diffusion"], {"text", "image"}, {"video"}),  # image-to-video: image in, no image out
    (["llm", "generation"], {"text"}, {"text", "audio"}),
])
def test_edits_need_the_edit_capability(parser, stage_types, inputs, outputs):
    engine = FakeOmni(stage_types=stage_types, output_modalities=outputs, input_modalities=inputs)
    client = make_client(parser, engine)
    resp = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", png(), "image/png")})
    err = assert_error(resp, 400, "/v1/images/edits needs a model that takes an input image and outputs images",
                       f"takes {sorted(inputs)}, makes {sorted(outputs)}")
    assert err["param"] == "image" and engine.seen == []


def test_chat_input_image_needs_a_model_that_takes_images(parser):
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"})  # text-to-image
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    err = assert_error(make_client(parser, engine).post("/v1/chat/completions", json={"messages": messages}), 400,
                       "does not take input images", "takes ['text'], makes ['image']")
    assert err["param"] == "messages[0].content" and engine.seen == []


def test_speech_needs_audio_output(dit):
    engine, client = dit
    seen = len(engine.seen)
    err = assert_error(client.post("/v1/audio/speech", json={"input": "hi"}), 400, "outputs audio")
    assert err["param"] == "model" and len(engine.seen) == seen


async def test_leaving_early_aborts_in_engine(dit):
    """A cancelled handler (what a disconnected client causes) aborts its request and the gauge drops."""
    engine, client = dit
    serving = client.app.state.serving_images
    engine.step_delay_s = 5.0
    try:
        params = serving.build_sampling_params_list()
        task = asyncio.create_task(serving.generate_final({"prompt": "x"}, "gone-1", params))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
    finally:
        engine.step_delay_s = 0.0
    assert "gone-1" in engine.aborted
    assert serving.metrics.running.labels("fake-model")._value.get() == 0
    assert json.loads(json.dumps(engine.aborted))


def test_playground_page_is_served_unless_disabled(parser):
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"})
    page = make_client(parser, engine).get("/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="image-send"' in page.text and "/v1/images/generations" in page.text
    assert make_client(parser, engine, "--disable-playground").get("/playground").status_code == 404


def test_openai_voices_and_audio_formats(ar):
    """OpenAI's voice names select the model's default voice (None), the model's own pass, others are a 400;
    the speech route encodes every OpenAI response_format (PyAV for the compressed ones)."""
    import av

    from vllm_omni.inputs.voices import resolve_voice

    assert (resolve_voice("alloy", {"ethan"}), resolve_voice("Ethan", {"ethan"}), resolve_voice(None, {})) == \
        (None, "ethan", None)
    with pytest.raises(ValueError, match="voice"):
        resolve_voice("nobody", {"ethan"})
    _, client = ar
    for fmt, codec in (("mp3", "mp3"), ("opus", "opus"), ("aac", "aac"), ("flac", "flac")):
        resp = client.post("/v1/audio/speech", json={"input": "hi", "voice": "alloy", "response_format": fmt})
        assert resp.status_code == 200, resp.text
        with av.open(io.BytesIO(resp.content)) as container:
            stream = container.streams.audio[0]
            assert stream.codec_context.name.startswith(codec)
            assert sum(frame.samples for frame in container.decode(stream)) > 0
