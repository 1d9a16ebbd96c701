"""Online FP8 (`--quantization fp8`): the quantize / GEMM math, which layers are quantized, and the pipeline.

Why it matters: FP8 must cost a bounded, stated accuracy and nothing else. torch's CPU `_scaled_mm` runs the same
row-wise-scaled FP8 GEMM as CUDA, so CPU checks the real path: weights per output channel and activations per
token within e4m3's half-ulp (2^-4 relative), an FP8 linear within 3% of fp32 on random data, the DiT's large
GEMMs quantized while embeddings / modulation / norms / final projection stay in the stage dtype, and a tiny
Qwen-Image image within 25 dB PSNR of its fp32 image (random tiny weights; real checkpoints are reported by
benchmarks/diffusion/bench_memory.py). Hardware without FP8 is refused with an error naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.layers.fp8 import (
    FP8_DTYPE,
    Fp8OnlineLinearMethod,
    check_fp8_supported,
    fp8_linear,
    quantize_rowwise,
)
from vllm_omni.errors import OmniClientError


def test_rowwise_quantization_is_within_half_an_ulp():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = quantize_rowwise(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (64, 1)
    back = q.float() * scale
    big = x.abs() > x.abs().amax(dim=1, keepdim=True) / 64  # e4m3 normals: 3 mantissa bits
    assert ((back - x).abs()[big] / x.abs()[big]).max() <= 2**-4 + 1e-6


def test_fp8_linear_matches_fp32():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 10, 128, generator=g), torch.randn(64, 128, generator=g) / 11, torch.randn(64, generator=g)
    wq, ws = quantize_rowwise(w)
    got, want = fp8_linear(x, wq, ws, b), torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape == (3, 10, 64)
    assert ((got - want).norm() / want.norm()).item() < 0.03


def test_pipeline_quantizes_the_large_gemms_only(dist_world):
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    model_dir = str(build_tiny("qwen-image"))
    images = []
    for flags in ({}, {"quantization": "fp8"}):
        runner = DiffusionModelRunner(
            OmniDiffusionConfig(model=model_dir, dtype="float32", **flags), torch.device("cpu")
        )
        runner.load_model()
        request = OmniDiffusionRequest(
            {"prompt": "a red fox", "negative_prompt": "blurry"},
            OmniDiffusionSamplingParams(seed=3, height=64, width=64, num_inference_steps=3, true_cfg_scale=4.0),
            "r",
        )
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([request]))
        assert out.error is None, out.error
        images.append(np.asarray(out.output[0], dtype=np.float64))
    methods = {
        name: type(m.quant_method)
        for name, m in runner.pipeline.transformer.named_modules()
        if hasattr(m, "quant_method")
    }
    fp8 = {name for name, method in methods.items() if method is Fp8OnlineLinearMethod}
    assert "transformer_blocks.0.attn.to_qkv" in fp8 and "transformer_blocks.0.img_mlp.net.0.proj" in fp8
    kept = {"img_in", "txt_in", "proj_out", "norm_out.linear", "transformer_blocks.0.img_mod.linear"}
    assert kept <= set(methods) and not kept & fp8
    assert runner.pipeline.transformer.transformer_blocks[0].attn.to_qkv.weight.dtype == FP8_DTYPE
    mse = np.mean((images[0] - images[1]) ** 2)
    assert images[0].std() > 1.0 and 10 * np.log10(255.0**2 / mse) >= 25.0


def test_ltx2_input_and_output_projections_stay_in_the_stage_dtype(dist_world):
    """LTX-2's patchify / unpatchify projections of both streams are this model's input embedding and final
    projection: they are kept like Qwen-Image's img_in / proj_out, the blocks' GEMMs are quantized."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from vllm_omni.diffusion.layers.fp8 import apply_online_fp8

    model = torch.nn.Module()
    for name in ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out"):
        setattr(model, name, ReplicatedLinear(64, 64, bias=True, prefix=name))
    model.block = torch.nn.Module()
    model.block.ff = ReplicatedLinear(64, 64, bias=True, prefix="block.ff")
    assert apply_online_fp8(model, torch.device("cpu")) == ["block.ff"]


def test_hardware_without_fp8_is_refused(monkeypatch):
    check_fp8_supported(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(OmniClientError, match="A100 has none") as exc:
        check_fp8_supported(torch.device("cuda", 0))
    assert exc.value.param == "quantization"


def test_quantization_flags_are_checked():
    with pytest.raises(OmniClientError, match="only 'fp8'"):
        OmniDiffusionConfig(model="m", quantization="int4")
    from vllm.config.quantization import QuantizationConfigArgs

    parsed = OmniDiffusionConfig(
        model="m", quantization="fp8", quantization_config=QuantizationConfigArgs(ignore=["a*"])
    )
    assert parsed.quantization_config == {"ignore": ["a*"]}
    with pytest.raises(OmniClientError, match="unknown key"):
        OmniDiffusionConfig(model="m", quantization="fp8", quantization_config={"group_size": 128})
    with pytest.raises(OmniClientError, match="without --quantization fp8"):
        OmniDiffusionConfig(model="m", quantization_config={"ignore": ["x"]})
