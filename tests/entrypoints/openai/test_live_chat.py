"""Live server on the tiny Qwen2 checkpoint (one AR stage on vLLM's EngineCore), started as
`vllm serve tiny/qwen2 --omni`. Pins: chat (stream and not) and batch chat through the official client and
raw HTTP, 4xx for routes/modalities the model cannot serve, and that a client leaving mid-stream aborts its
request in the engine (the running gauge drops back to 0 and the abort is counted)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.live_server import LiveServer

MODEL = "tiny/qwen2"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(MODEL, "--gpu-memory-utilization", "0.15", "--max-model-len", "512",
                     "--max-num-seqs", "4", "--enforce-eager")
    yield srv
    assert srv.close(), f"server did not shut down cleanly on SIGTERM; log: {srv.log}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 16
    assert isinstance(choice.message.content, str) and choice.message.content
    assert out.usage.prompt_tokens > 0

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streamed deltas add up to the non-streamed answer
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert chunks[-1].usage.completion_tokens == 16


def test_batch_chat(server):
    body = {"model": MODEL, "messages": [MESSAGES, [{"role": "user", "content": "bye"}]], "max_tokens": 5,
            "ignore_eos": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions/batch", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["id"].startswith("chatcmpl-batch-")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert all(isinstance(c["message"]["content"], str) for c in data["choices"])  # random weights: may be ""
    assert data["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MESSAGES, "sampling_params_list": [{"max_tokens": 2}, {}]},
         "one entry per stage"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "only text parts"),
        ("/v1/images/generations", {"prompt": "a cat"}, "outputs image"),
        ("/v1/audio/speech", {"input": "hello"}, "outputs audio"),
    ],
)
def test_unservable_or_bad(server, path, body, needle):
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_disconnect_mid_stream_aborts(server):
    aborted_before = server.metric("vllm_omni:engine_requests_total", outcome="aborted")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                       json=body) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data:")
            if seen >= 3:
                break  # leave mid-stream: closing the connection is the disconnect
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.metric("vllm_omni:requests_running") == 0:
            break
        time.sleep(0.1)
    assert server.metric("vllm_omni:requests_running") == 0
    assert server.metric("vllm_omni:engine_requests_total", outcome="aborted") == aborted_before + 1
    # the engine is free again: a new request is served right away
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                      timeout=60)
    assert resp.status_code == 200


def test_no_5xx_recorded(server):
    assert server.metric("vllm_omni:http_requests_total", status="500") == 0
