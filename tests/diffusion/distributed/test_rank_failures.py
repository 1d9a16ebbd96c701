"""A request that fails on one rank of two (gloo, Ulysses 2, real workers) in request and in step mode.

What it pins: an error every rank hits alike fails that request with its own error and the workers go on (no
restart); a fault on rank 1 only, after the last collective (decode) or inside the transformer forward (rank 0
then waits in the forward's all-to-all until `distributed_timeout_seconds`), fails that request with rank 1's
own error (500, its message), the stage restarts its workers once, and the next request on the same engine
succeeds; no wait outlasts its bound. Rank 1 fails alone in the forward in request mode and in the decode in
step mode.
"""

from __future__ import annotations

import time

import pytest
from fault_pipelines import FaultyQwenImagePipeline

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

TIMEOUT_S = 15
"""distributed_timeout_seconds: long enough for the ranks' start-up rendezvous on a busy CPU."""


@pytest.fixture(scope="module", params=["request_mode", "step_mode"])
def engine(request):
    from vllm_omni.catalog.tiny import build_tiny

    config = OmniDiffusionConfig(
        model=str(build_tiny("qwen-image")),
        model_class_name=f"{FaultyQwenImagePipeline.__module__}:{FaultyQwenImagePipeline.__qualname__}",
        parallel_config=DiffusionParallelConfig(ulysses_degree=2, distributed_timeout_seconds=TIMEOUT_S),
        step_execution=request.param == "step_mode")
    engine = DiffusionEngine(config)
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)


def _run(engine, prompt: str, timeout: float):
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=3, seed=0, output_type="np")
    return engine.submit(OmniDiffusionRequest({"prompt": prompt}, params, f"{prompt}-{time.monotonic()}")
                         ).result(timeout)


def _serves_next(engine, restarts: int) -> None:
    out = _run(engine, "a red cube", 180)  # waits for the restarted workers
    assert out.error is None and out.output is not None
    assert engine.stats()["num_restarts"] == restarts and not engine.stats()["is_dead"]


@pytest.mark.slow
def test_failure_on_every_rank_fails_the_request_alone(engine):
    restarts = engine.stats()["num_restarts"]
    out = _run(engine, "fault-decode-all", 60)
    assert out.error_status_code == 500 and "injected fault in the decode on every rank" in out.error
    _serves_next(engine, restarts)


RANK_1_FAULT = {"request_mode": "forward", "step_mode": "decode"}
"""Where rank 1 alone fails, per mode: each mode's failure comparison and each kind of fault (after the last
collective, inside one) once, for CI time (a restart each; a forward fault also waits out the timeout)."""


@pytest.mark.slow
def test_fault_on_rank_1_only_fails_the_request_and_the_stage_recovers(engine, request):
    where = RANK_1_FAULT[request.node.callspec.params["engine"]]
    restarts = engine.stats()["num_restarts"]
    start = time.monotonic()
    out = _run(engine, f"fault-{where}", 4 * TIMEOUT_S)
    assert out.error_status_code == 500 and f"injected fault in the {where}" in out.error and "rank 1" in out.error
    assert time.monotonic() - start < (2.5 * TIMEOUT_S if where == "forward" else TIMEOUT_S)
    _serves_next(engine, restarts + 1)
