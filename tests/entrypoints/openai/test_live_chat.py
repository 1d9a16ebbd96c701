"""Live server on the tiny Qwen2 checkpoint (one AR stage on vLLM's EngineCore), started as
`vllm serve tiny/qwen2 --omni`. Pins: chat (stream and not) and batch chat through the official client and
raw HTTP, 4xx for routes/modalities the model cannot serve, that a client leaving mid-stream aborts its
request in the engine (the running gauge drops back to 0 and the abort is counted), and tool calling through
vLLM's hermes parser (required / named tool choice constrain the random model to well-formed calls)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.live_server import LiveServer

MODEL = "tiny/qwen2"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL, "--gpu-memory-utilization", "0.15", "--max-model-len", "2048",
                     "--max-num-seqs", "4", "--enforce-eager", "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes")
    yield srv
    stop_later(srv)


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


def test_n_completions(client):
    """n > 1: n choices from one request (vLLM's parallel sampling), streamed per choice index too."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=0, n=3,
              extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in out.choices)
    assert out.usage.completion_tokens == 3 * 8
    assert len({c.message.content for c in out.choices}) > 1  # each child samples with its own seed

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finish = {}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.message.content for c in out.choices}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 3 * 8


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
    # 2,000 tokens: the tiny model made 450 before a loaded server saw the disconnect (finished, not aborted)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                       json=body) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data:")
            if seen >= 1:
                break  # leave at the first chunk
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


CITIES = ["Paris", "Rome"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Seeded sampling: greedy decoding of the random model pads the constrained JSON with whitespace forever.
SAMPLE = dict(max_tokens=200, temperature=1.0, seed=0)


def _calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def test_tool_choice_required_and_named(client):
    out = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                         **SAMPLE)
    choice = out.choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason == "tool_calls", choice
    assert all(name in {"get_weather", "get_time"} and args["city"] in CITIES for name, args in calls)
    assert all(call.id and call.type == "function" for call in choice.message.tool_calls)

    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=named, **SAMPLE)
    assert [name for name, _ in _calls(out.choices[0].message)] == ["get_time"]
    assert out.choices[0].finish_reason == "stop"  # OpenAI: a named tool call finishes with "stop"

    stream = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=named,
                                            stream=True, **SAMPLE)
    streamed: dict[int, dict[str, str]] = {}
    for c in stream:
        for delta in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert [(v["name"], json.loads(v["arguments"])) for v in streamed.values()] == _calls(out.choices[0].message)


def test_tool_results_in_history_and_auto_choice(client):
    """A conversation carrying an assistant tool call and its result renders and runs: the tool turns reach the
    prompt (it has more tokens than the conversation without them) and greedy decoding answers it the same way
    twice. Under "auto" the random model may or may not call a tool; the answer is well-formed either way."""
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens > without.usage.prompt_tokens  # the call and its result were rendered
    assert (again.choices[0].message.content, _calls(again.choices[0].message)) == (
        out.choices[0].message.content, _calls(out.choices[0].message))
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert all(name in {"get_weather", "get_time"} for name, _ in _calls(choice.message))

