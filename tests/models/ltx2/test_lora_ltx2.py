"""Per-request LoRA on LTX-2's native DiT vs diffusers' `load_lora_weights` + `set_adapters` (fp32, tiny weights).

Why it matters: the adapters land on our vLLM linears through `lora_target` (diffusers' module names are ours), so
a file written for diffusers' `LTX2VideoTransformer3DModel` must change our clip exactly as it changes diffusers'.
"""

from __future__ import annotations

import torch

from tests.models.ltx2.test_pipeline_ltx2 import psnr, reference, request, snr
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch


def test_lora_matches_diffusers(dist_world, ltx2_dir, tmp_path):
    from diffusers import LTX2Pipeline as RefPipeline

    from vllm_omni.models.ltx2.pipeline import LTX2Pipeline

    path = write_tiny_lora(ltx2_dir, tmp_path / "a.safetensors", rank=4, seed=1)
    ours = LTX2Pipeline.from_pretrained(
        OmniDiffusionConfig(model=str(ltx2_dir), enable_lora=True), ltx2_dir, torch.device("cpu"), torch.float32
    )
    ref = RefPipeline.from_pretrained(ltx2_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(str(path), adapter_name="a")
    ref.set_adapters(["a"], [0.8])
    want_video, want_audio = reference(ref, "A cat walks.", 5, 3.0, 24)
    lora = [{"path": str(path), "scale": 0.8}]
    got, base = ours.forward(
        DiffusionRequestBatch(
            [
                request("A cat walks.", 5, "lora", guidance_scale=3.0, fps=24, lora=lora),
                request("A cat walks.", 5, "base", guidance_scale=3.0, fps=24),
            ]
        )
    )
    assert got.error is None and base.error is None, (got.error, base.error)
    assert psnr(got.output["video"], want_video) >= 35.0
    assert snr(got.output["audio"], want_audio) >= 40.0
    assert psnr(base.output["video"], want_video) < 30.0, "the adapter must change the clip"
