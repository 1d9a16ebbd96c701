"""Wan DiT at tensor-parallel size 2 (two gloo worker processes) vs diffusers on the same tiny weights.

Why it matters: the TP path shards heads across ranks (column/row-parallel linears, RMSNorm over all heads with an
all-reduced sum of squares, sharded norm weights); world size 1 never exercises it. Also: the segments of vLLM CPU's
TP communicator are gone once the engine is closed (its workers do not unlink them; the executor does).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.entrypoints.leak_checks import orphan_segments, shm_segments
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

SIZE = dict(height=32, width=48, num_frames=9, num_inference_steps=3, max_sequence_length=64)


@pytest.mark.slow
def test_tp2_matches_diffusers(wan21_t2v_dir):
    from diffusers import WanPipeline as RefPipeline

    before = shm_segments()
    engine = DiffusionEngine(OmniDiffusionConfig.from_kwargs(model=str(wan21_t2v_dir), tensor_parallel_size=2))
    try:
        request = OmniDiffusionRequest("A cat walks.", OmniDiffusionSamplingParams(seed=7, **SIZE), "tp2")
        out = engine.submit(request).result(300)
    finally:
        engine.close()
    assert out.error is None, out.error
    assert not [name for name in orphan_segments(before) if "-cpushm_" in name]  # other test processes' are mapped
    ref = RefPipeline.from_pretrained(wan21_t2v_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected = ref(prompt="A cat walks.", generator=torch.Generator("cpu").manual_seed(7), output_type="np",
                   **SIZE).frames[0]
    video = out.output["video"].astype(np.float64)
    mse = np.mean((video - (expected * 255).round()) ** 2)
    assert video.std() > 1.0
    assert mse == 0 or 10 * np.log10(255.0**2 / mse) >= 60.0
