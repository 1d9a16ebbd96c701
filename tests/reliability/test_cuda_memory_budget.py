"""The diffusion admission budget on CUDA, on a live `vllm serve tiny/qwen-image --omni` (issue 13).

Without `--diffusion-memory-budget-gb` the budget is what `torch.cuda.mem_get_info` says is free on the
workers once the model is loaded (on CPU there is no such number: tests/diffusion/test_memory_admission.py
covers the flag). What it pins: a request whose estimate at its shape is bigger than that free memory is a 400
naming the field that makes it too big, before anything is queued, and quotes a budget no bigger than the GPU;
a normal request on the same server runs.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.entrypoints.openai.live_server import LiveServer
from tests.reliability.conftest import assert_client_error

pytestmark = pytest.mark.cuda

MAX_STEPS = 10**9
"""--max-inference-steps, raised so the request below reaches the memory check: tiny Qwen-Image's step tables
take ~6 KB per step at 32x32 in bf16, so 10**9 steps are ~6 TB, more than any GPU has free."""


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("tiny/qwen-image", "--max-inference-steps", str(MAX_STEPS))
    yield srv
    assert srv.close(), f"server did not shut down cleanly on SIGTERM; log: {srv.log}"


def test_request_bigger_than_free_memory_is_a_400(server):
    import torch

    total = torch.cuda.mem_get_info()[1]
    resp = httpx.post(f"{server.url}/v1/images/generations", timeout=60,
                      json={"prompt": "x", "size": "32x32", "num_inference_steps": MAX_STEPS})
    err = assert_client_error(resp, "num_inference_steps")
    budget_gib = float(re.search(r"more than the ([0-9.]+) GiB", err["message"]).group(1))
    assert 0 < budget_gib * 2**30 <= total, err["message"]


def test_normal_request_runs(server):
    resp = httpx.post(f"{server.url}/v1/images/generations", timeout=120,
                      json={"prompt": "x", "size": "32x32", "num_inference_steps": 2, "response_format": "b64_json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["data"][0]["b64_json"]
