"""Two ranks on CPU (gloo): every rank gets every batch, rank 0 answers, collective_rpc hears from both.

What it pins: the multi-rank launch (shared TCP init method, per-rank sockets and result threads), that
outputs come back once per request, and that close() stops both workers.
"""

from __future__ import annotations

import pytest
from fake_pipelines import FakeBatchPipeline, class_path

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


@pytest.mark.slow
def test_two_ranks_serve_and_shut_down(tmp_path):
    config = OmniDiffusionConfig(model=str(tmp_path), model_class_name=class_path(FakeBatchPipeline),
                                 parallel_config=DiffusionParallelConfig(tensor_parallel_size=2), max_num_seqs=2)
    engine = DiffusionEngine(config)
    try:
        infos = engine.collective_rpc("ping", timeout=60)
        assert [i["rank"] for i in infos] == [0, 1]
        assert len({i["pid"] for i in infos}) == 2
        futures = [engine.submit(OmniDiffusionRequest(p, SP(seed=1), p)) for p in ("a", "b", "c")]
        outs = [f.result(60) for f in futures]
        assert all(o.error is None and len(o.output) == 1 for o in outs)
        assert engine.stats()["num_requests_finished"] == 3
    finally:
        engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)
