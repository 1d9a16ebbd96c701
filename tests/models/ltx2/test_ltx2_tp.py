"""LTX-2 at tensor-parallel size 2 (two gloo worker processes) vs diffusers on the same tiny weights.

Why it matters: the TP path shards every attention's heads across ranks (video, audio, text and the audio-video
cross-attentions), all-reduces the q/k norms' sum of squares and slices the per-head RoPE tables to each rank's
heads; world size 1 never exercises any of it.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.ltx2.test_pipeline_ltx2 import SIZE, psnr, reference, snr
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.mark.slow
def test_tp2_matches_diffusers(ltx2_dir):
    from diffusers import LTX2Pipeline as RefPipeline

    engine = DiffusionEngine(OmniDiffusionConfig.from_kwargs(model=str(ltx2_dir), tensor_parallel_size=2))
    try:
        params = OmniDiffusionSamplingParams(seed=7, guidance_scale=3.0, fps=24, **SIZE)
        out = engine.submit(OmniDiffusionRequest("A cat walks on the grass.", params, "tp2")).result(300)
    finally:
        engine.close()
    assert out.error is None, out.error
    ref = RefPipeline.from_pretrained(ltx2_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected_video, expected_audio = reference(ref, "A cat walks on the grass.", 7, 3.0, 24)
    assert out.output["video"].std() > 1.0
    assert psnr(out.output["video"], expected_video) >= 35.0
    assert snr(out.output["audio"], expected_audio) >= 40.0
