"""Layerwise offload (`--enable-layerwise-offload`) and model-level CPU offload (`--enable-cpu-offload`).

Why it matters: offload must change where weights live, never what the model computes. On CPU the "device" is
the CPU, and the mechanism runs all the same: offloaded blocks hold empty placeholders between forwards, each
forward binds a fetched copy, the next blocks' fetches are issued ahead. Qwen-Image, FLUX and Wan tiny pipelines
(fp32) with blocks offloaded (one kept resident) and the text encoders / VAE offloaded give their resident
outputs bit for bit (asserted as PSNR >= 60 dB and exact equality).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.offload.components import apply_cpu_offload
from vllm_omni.diffusion.offload.layerwise import apply_layerwise_offload, iter_offloaders
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

CPU = torch.device("cpu")
FAMILIES = {
    "qwen-image": (
        "vllm_omni.models.qwen_image.pipeline:QwenImagePipeline",
        dict(height=64, width=64, num_inference_steps=3, true_cfg_scale=4.0),
    ),
    "flux": ("vllm_omni.models.flux.pipeline:FluxPipeline", dict(height=64, width=64, num_inference_steps=3)),
    "wan2.1-t2v": (
        "vllm_omni.models.wan.pipeline:WanPipeline",
        dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=5.0),
    ),
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _pixels(output) -> np.ndarray:
    value = output["video"] if isinstance(output, dict) else output[0]
    return np.asarray(value, dtype=np.float64) * (255.0 if np.asarray(value).dtype != np.uint8 else 1.0)


def load(family: str, model_dir: Path, **flags):
    """The pipeline as a worker's model runner loads it (offload hooks included)."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    runner = DiffusionModelRunner(OmniDiffusionConfig(model=str(model_dir), dtype="float32", **flags), CPU)
    runner.load_model()
    assert type(runner.pipeline).__name__ == FAMILIES[family][0].split(":")[1]
    return runner.pipeline


def generate(pipe, family: str) -> np.ndarray:
    params = FAMILIES[family][1]
    request = OmniDiffusionRequest(
        prompt={"prompt": "a red fox in snow", "negative_prompt": "blurry"},
        sampling_params=OmniDiffusionSamplingParams(seed=5, **params),
        request_id="r",
    )
    (out,) = pipe.forward(DiffusionRequestBatch([request]))
    assert out.error is None, out.error
    return _pixels(out.output)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offloaded_pipeline_equals_resident(dist_world, family):
    from vllm_omni.catalog.tiny import build_tiny

    model_dir = build_tiny(family)
    expected = generate(load(family, model_dir), family)
    pipe = load(
        family,
        model_dir,
        enable_layerwise_offload=True,
        offload_resident_layers=1,
        offload_prefetch_layers=2,
        enable_cpu_offload=True,
    )
    (offloader,) = iter_offloaders(pipe.transformer)
    assert offloader.num_offloaded >= 1
    on_device = []  # the offloaded component on the device at each transformer forward
    pipe.transformer.register_forward_pre_hook(lambda module, args: on_device.append(pipe.cpu_offloader.active))
    got = generate(pipe, family)
    assert on_device and set(on_device) == {None}, "the skeleton sends every component back before a forward"
    assert expected.std() > 1.0, "constant outputs would prove nothing"
    assert psnr(got, expected) >= 60.0
    np.testing.assert_array_equal(got, expected)
    steps = FAMILIES[family][1]["num_inference_steps"]
    assert offloader.fetches >= steps * offloader.num_offloaded, "every offloaded block was fetched every step"
    # The blocks' weights really moved (on CPU vLLM would otherwise keep linears in oneDNN handles)...
    assert all(slot.shape.numel() > 0 for p in offloader.packed for slots in p.slots.values() for slot in slots)
    for packed in offloader.packed:  # ...and nothing of an offloaded block stays bound after the forward
        assert all(packed._get(slot).numel() == 0 for slots in packed.slots.values() for slot in slots)
    assert pipe.cpu_offloader.active == "vae"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mod = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale + x


class _Model(nn.Module):
    _repeated_blocks = ("_Block",)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x

    def modulation(self, t: torch.Tensor) -> torch.Tensor:
        """Block submodules called outside the blocks' forwards (as Qwen-Image's step modulation)."""
        return torch.stack([block.mod(t) for block in self.blocks])


def test_offloader_fetches_ahead_and_releases():
    model, x = _Model(), torch.randn(3, 4)
    expected, expected_mod = model(x), model.modulation(x)
    offloader = apply_layerwise_offload(model, CPU, resident_layers=1, prefetch=2)
    assert offloader.num_offloaded == 3 and model.blocks[0].proj.weight.numel() == 16
    assert model.blocks[1].proj.weight.numel() == 0 and model.blocks[3].scale.numel() == 0
    assert offloader.bytes_per_pass() == 3 * (2 * (16 + 4) + 4) * 4
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    # Block 3 prefetched blocks 1 and 2 (cyclic) for the next pass; 3 + 2 fetches so far.
    assert offloader.fetches == 5 and sorted(offloader.pending) == [0, 1]
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(model.modulation(x), expected_mod, rtol=0, atol=0)
    assert not offloader.owner and all(model.blocks[i].mod.weight.numel() == 0 for i in (1, 2, 3))
    offloader.remove()
    assert model.blocks[2].proj.weight.shape == (4, 4)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_cpu_offload_keeps_one_component_and_evicts_all():
    class _Pipe:
        text_encoder, vae = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))

    pipe = _Pipe()
    offloader = apply_cpu_offload(pipe, CPU)
    assert pipe.cpu_offloader is offloader
    pipe.text_encoder(torch.ones(1, 2))
    assert offloader.active == "text_encoder"
    offloader.offload_all()  # what the skeleton calls before each transformer forward
    assert offloader.active is None
    pipe.vae[0](torch.ones(1, 2))  # a direct child's forward onloads its component
    assert offloader.active == "vae"
    with pytest.raises(ValueError, match="has none of the components"):
        apply_cpu_offload(object(), CPU)


def test_offload_flags_are_checked():
    config = OmniDiffusionConfig(model="m", enable_layerwise_offload=True, device="cpu")
    assert config.enforce_eager is True
    with pytest.raises(OmniClientError, match="runs the transformer eager") as exc:
        OmniDiffusionConfig(model="m", enable_layerwise_offload=True, enforce_eager=False)
    assert exc.value.param == "enable_layerwise_offload"
    with pytest.raises(OmniClientError, match="offload_resident_layers"):
        OmniDiffusionConfig(model="m", offload_resident_layers=-1)
    with pytest.raises(OmniClientError, match="1 or 2"):
        OmniDiffusionConfig(model="m", offload_prefetch_layers=3)


def test_fp8_blocks_offload_like_any_other(dist_world):
    """FP8 weights and their scales are packed and streamed as the block's other tensors."""
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE

    model_dir = build_tiny("qwen-image")
    expected = generate(load("qwen-image", model_dir, quantization="fp8"), "qwen-image")
    pipe = load("qwen-image", model_dir, quantization="fp8", enable_layerwise_offload=True)
    (offloader,) = iter_offloaders(pipe.transformer)
    assert FP8_DTYPE in offloader.packed[0].slots
    np.testing.assert_array_equal(generate(pipe, "qwen-image"), expected)
