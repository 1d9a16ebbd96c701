"""What the fake engine cannot show, on a live `vllm serve tiny/qwen2 --omni` (real tokenizer, real EngineCore):
D5 (a lone surrogate reached the tokenizer: 500 TypeError), D18 (`sampling_params_list` bypassed
--max-request-outputs, any role accepted), D12 (an untrusted request template; /health stalled for seconds while
a 5 MB prompt was tokenized in the event loop) and that the engine still serves afterwards."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.entrypoints.openai.live_server import QWEN2
from tests.reliability.conftest import assert_client_error

J = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*QWEN2)


@pytest.mark.parametrize("body,param", [
    ('{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":8}', "messages[0].content"),
    ('{"messages":[{"role":"user","content":"hi"}],"sampling_params_list":[{"max_tokens":4,"n":1000}]}',
     "sampling_params_list[0].n"),
    ('{"messages":[{"role":"hacker","content":"hi"}]}', "messages[0].role"),
    ('{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', "temperature"),
    ('{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"chat_template":"{% for i in range(20000) %}'
     '{% for j in range(20000) %}{% endfor %}{% endfor %}hi"}', "chat_template"),
])
def test_refused_with_the_field_named(server, body, param):
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=body.encode(), headers=J, timeout=60)
    assert_client_error(resp, param)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"messages": [{"author": {"role": "user"}, "content": [{"type": "text", "text": "hi"}]}]},
     "messages[0].role"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [2**63 + 1]}, "tokens"),
    ("/detokenize", {"tokens": ["5000000000", 5e9]}, "tokens"),  # ids as the request model reads them
])
def test_vllm_routes_refuse_what_their_handlers_cannot_take(server, path, body, param):
    """vLLM's own /tokenize and /detokenize (mounted for an AR-first pipeline) answered 500 (TypeError,
    OverflowError) to these; the vLLM handler still serves good requests."""
    assert_client_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), param)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}, timeout=60).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"] == "hi"


def test_vllm_route_without_its_serving_object_is_a_404(server):
    """vLLM mounts /v1/systemone for every generate model; this one has no structured-decision strategy, so
    vLLM's handler raised NotImplementedError (was 500 here, 501 on plain vLLM)."""
    resp = httpx.post(f"{server.url}/v1/systemone", json={"state": "x", "questions": {}}, timeout=60)
    assert resp.status_code == 404, resp.text
    assert "/v1/systemone" in resp.json()["error"]["message"] and resp.json()["error"]["code"] == 404


async def test_health_while_a_large_prompt_is_tokenized(server):
    body = json.dumps({"messages": [{"role": "user", "content": "a " * (2 * 2**20)}], "max_tokens": 4})
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        await client.get("/health")
        request = asyncio.create_task(client.post("/v1/chat/completions", content=body, headers=J))
        latencies = []
        while not request.done():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)
        resp = await request
    assert resp.status_code == 400, resp.text  # vLLM refuses the prompt as longer than --max-model-len
    assert max(latencies) < 0.1, latencies


def test_still_serving(server):
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] is not None
