"""Two ranks on CPU (gloo): every rank gets every batch, rank 0 answers, collective_rpc hears from both.

What it pins: the multi-rank launch (shared TCP init method, per-rank sockets and result threads), that
outputs come back once per request, that an abort stops both ranks at the same step (each rank reads the abort
channel on its own; rank 0's decision travels to the other), so no rank is left in a collective and the worker
serves the next request, and that close() stops both workers.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_pipelines import FakeCollectivePipeline, class_path

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Two TP ranks of `FakeCollectivePipeline` (it behaves as `FakeBatchPipeline` but for "collective")."""
    config = OmniDiffusionConfig(model=str(tmp_path_factory.mktemp("model")),
                                 model_class_name=class_path(FakeCollectivePipeline),
                                 parallel_config=DiffusionParallelConfig(tensor_parallel_size=2), max_num_seqs=2)
    engine = DiffusionEngine(config)
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)


@pytest.mark.slow
def test_two_ranks_serve_and_shut_down(engine):
    infos = engine.collective_rpc("ping", timeout=60)
    assert [i["rank"] for i in infos] == [0, 1]
    assert len({i["pid"] for i in infos}) == 2
    futures = [engine.submit(OmniDiffusionRequest(p, SP(seed=1), p)) for p in ("a", "b", "c")]
    outs = [f.result(60) for f in futures]
    assert all(o.error is None and len(o.output) == 1 for o in outs)
    assert engine.stats()["num_requests_finished"] == 3


def _steps_run(engine, request_id: str, timeout_s: float = 30.0) -> list[int]:
    files = [Path(engine.od_config.model, f"{request_id}.rank{r}") for r in (0, 1)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return [int(f.read_text()) for f in files]
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{request_id}: not every rank finished within {timeout_s} s")


@pytest.mark.slow
def test_abort_stops_both_ranks_at_the_same_step(engine):
    for attempt in range(3):  # three aborts at different points of a step
        rid = f"long-{attempt}"
        engine.submit(OmniDiffusionRequest("collective", SP(seed=1, num_inference_steps=100_000), rid))
        time.sleep(0.5 + 0.017 * attempt)
        engine.abort([rid])
        steps = _steps_run(engine, rid)
        assert steps[0] == steps[1] and 0 < steps[0] < 100_000, steps
    out = engine.submit(OmniDiffusionRequest("collective", SP(seed=1, num_inference_steps=3), "next")).result(30)
    assert out.error is None and _steps_run(engine, "next") == [3, 3]
