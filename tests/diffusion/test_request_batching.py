"""Request batching with the native Qwen-Image pipeline on tiny weights, through real worker processes.

What it pins: N compatible requests submitted together run in ONE forward (visible in stats) and give the
same images as the same N requests run one at a time; requests of another size do not join the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

COMMON = {"height": 64, "width": 64, "num_inference_steps": 3, "true_cfg_scale": 4.0}
PROMPTS = ["a cat holding a sign", "a red car at night", "mountains and a lake"]


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(
        OmniDiffusionConfig(model="tiny/qwen-image", max_num_seqs=3, request_batch_max_wait_ms=500)
    )
    yield engine
    engine.close()


def make(i: int, tag: str, **overrides) -> OmniDiffusionRequest:
    prompt = {"prompt": PROMPTS[i], "negative_prompt": "blurry"}
    return OmniDiffusionRequest(prompt, SP(seed=100 + i, **{**COMMON, **overrides}), f"{tag}-{i}")


def test_batch_runs_in_one_forward_and_matches_single_requests(engine):
    assert engine.model_class_name == "QwenImagePipeline" and engine.supports_request_batch
    singles = []
    for i in range(3):  # one at a time: each waits out the batch window alone
        singles.append(engine.submit(make(i, "single")).result(120))
    before = engine.stats()
    futures = [engine.submit(make(i, "batched")) for i in range(3)]
    batched = [f.result(120) for f in futures]
    after = engine.stats()
    assert after["num_forwards"] - before["num_forwards"] == 1
    assert after["batch_sizes"].get(3, 0) - before["batch_sizes"].get(3, 0) == 1
    for alone, together in zip(singles, batched, strict=True):
        assert alone.error is None and together.error is None
        a = np.asarray(alone.output[0]).astype(np.int16)
        b = np.asarray(together.output[0]).astype(np.int16)
        assert np.abs(a - b).max() <= 1, "a co-batched request must land where it would alone"


def test_other_size_does_not_join_the_batch(engine):
    before = engine.stats()["num_forwards"]
    futures = [engine.submit(make(0, "mixed")), engine.submit(make(1, "mixed", height=32, width=32))]
    outs = [f.result(120) for f in futures]
    assert engine.stats()["num_forwards"] - before == 2
    assert [o.output[0].size for o in outs] == [(64, 64), (32, 32)]
