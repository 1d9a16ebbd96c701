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
