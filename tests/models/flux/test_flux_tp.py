"""FLUX at tensor-parallel size 2 (two gloo worker processes through DiffusionEngine) vs diffusers, same tiny weights.

Why it matters: TP shards heads and the MLP across ranks, and the single-stream `proj_out` takes the concatenated
[attention | MLP] activations, whose input columns `load_weights` re-orders so each rank's row-parallel slice is its
own heads + MLP shard; world size 1 never exercises that.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.mark.slow
def test_tp2_matches_diffusers(flux_dir):
    from diffusers import FluxPipeline

    engine = DiffusionEngine(OmniDiffusionConfig.from_kwargs(model=str(flux_dir), tensor_parallel_size=2))
    try:
        sp = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=3, seed=5)
        out = engine.submit(OmniDiffusionRequest("a red chair by the river", sp, "tp2")).result(300)
    finally:
        engine.close()
    assert out.error is None, out.error
    ref = FluxPipeline.from_pretrained(flux_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    want = np.asarray(ref(prompt="a red chair by the river", height=64, width=64, num_inference_steps=3,
                          generator=torch.Generator("cpu").manual_seed(5)).images[0], dtype=np.float64)
    got = np.asarray(out.output[0], dtype=np.float64)
    mse = np.mean((got - want) ** 2)
    assert got.std() > 1.0
    assert mse == 0 or 10 * np.log10(255.0**2 / mse) >= 40.0
