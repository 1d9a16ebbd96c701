"""Live `vllm serve tiny/qwen2 --omni` as a drop-in for `vllm serve` (issue 18), through the official `openai`
client and vLLM's own `vllm bench serve`. Pins: vLLM's routes answer on the AR stage (completions, responses,
chat logprobs, tokenize / detokenize, version, ping, models with max_model_len), a route vLLM does not offer
for the model is a 404 saying why, unknown fields (`store`, `metadata`) are ignored with a warning, /metrics
has vLLM's `vllm:*` series labelled by stage, and `vllm bench serve` sees one chunk per token.

The other acceptance calls live with the servers they need: `images.generate(quality="standard")` in
test_live_diffusion.py, `audio.speech.create(voice="alloy", response_format="mp3")` in
tests/models/qwen3_omni/test_serve_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.live_server import QWEN2
from vllm_omni.catalog.tiny import resolve_model

MODEL = QWEN2[0]
MESSAGES = [{"role": "user", "content": "hello"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*QWEN2)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_completions(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    streamed = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True,
                                         extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_responses(client):
    out = client.responses.create(model=MODEL, input="hello", max_output_tokens=5, extra_body=NO_EOS)
    assert out.status == "incomplete" and out.usage.output_tokens == 5


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         top_logprobs=2, extra_body=NO_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(token.top_logprobs) == 2 for token in content)


def test_store_and_metadata_are_ignored_with_a_warning(client, server):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, store=True,
                                         metadata={"team": "a"}, temperature=0, extra_body=NO_EOS)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                           extra_body=NO_EOS)
    assert out.usage.completion_tokens == 2 and out.choices[0].message.content == plain.choices[0].message.content
    assert "ignoring unknown request field(s) ['metadata', 'store']" in server.log.read_text()


def test_vllm_routes(server):
    get = lambda path: httpx.get(server.url + path, timeout=30)  # noqa: E731
    assert get("/version").json()["version"]
    assert get("/ping").status_code == 200
    assert get("/v1/models").json()["data"][0]["max_model_len"] == 512
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert text == "hello world"
    missing = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert missing.status_code == 404 and "generate" in missing.json()["error"]["message"]


def test_vllm_metrics_per_stage(server, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    labels = {"stage_id": "0", "stage_type": "llm"}
    assert "vllm:num_requests_running{" in httpx.get(f"{server.url}/metrics").text
    assert server.metric("vllm:time_to_first_token_seconds_count", **labels) > 0
    assert server.metric("vllm:generation_tokens_total", **labels) > 0


@pytest.fixture(scope="module")
def bench_result(server, tmp_path_factory):
    """vLLM's own benchmark client on the acceptance workload: openai-chat, random 32-token prompts, 16 output
    tokens, 20 prompts, concurrency 8; its detailed result (per-request inter-chunk gaps)."""
    out_dir = tmp_path_factory.mktemp("bench")
    vllm = str(Path(sys.executable).with_name("vllm"))
    cmd = [vllm, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", server.url, "--model", MODEL, "--tokenizer", resolve_model(MODEL), "--dataset-name",
           "random", "--random-input-len", "32", "--random-output-len", "16", "--num-prompts", "20",
           "--max-concurrency", "8", "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(out_dir), "--result-filename", "bench.json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads((out_dir / "bench.json").read_text())


def test_bench_serve(bench_result):
    assert bench_result["completed"] == 20 and bench_result["failed"] == 0
    assert bench_result["total_output_tokens"] == 20 * 16


def test_bench_serve_streams_every_token(bench_result):
    """As from plain `vllm serve`: every engine output is a chunk of its own, so the 16 tokens arrive in about 16
    chunks (16 gaps after the role chunk on an idle machine). vLLM's own output collector merges the outputs a
    lagging reader has not taken yet, as it does for plain `vllm serve`, so a loaded machine sees a few fewer; the
    old coalescing stream sent 3-8 chunks for 16 tokens."""
    gaps = sorted(len(g) for g in bench_result["itls"])
    assert gaps[len(gaps) // 2] >= 12, gaps
