"""The compiled path's VAE decode (`accelerate_decoder`): the decoders of the families that set `compile_vae_decoder`
trace whole in Dynamo and decode as eager; the model runner's switch applies it only where the DiT runs compiled;
on CUDA, Inductor's decoder of every such family keeps the image (PSNR >= 40 dB against eager) and compiles once
more for a second batch size, then serves it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.layers.compile import (
    accelerate_decoder,
    accelerate_transformer,
    accelerate_vae_if_requested,
    compiled_forward,
)

# (tiny checkpoint, diffusers VAE class, latent rank): the VAEs of the families with `compile_vae_decoder`.
FAMILY_VAES = {
    "flux2-klein": ("AutoencoderKLFlux2", 4),
    "qwen-image-2.1": ("AutoencoderKLQwenImage21", 5),
    "hunyuan-image-2.1": ("AutoencoderKLHunyuanImage", 4),
    "qwen-image": ("AutoencoderKLQwenImage", 5),
}
"""FLUX.1 and Z-Image decode with `AutoencoderKL`, the same decoder as FLUX.2's without its batch norm."""


def tiny_vae(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    import diffusers

    from vllm_omni.catalog.tiny import build_tiny

    cls, rank = FAMILY_VAES[name]
    vae = getattr(diffusers, cls).from_pretrained(build_tiny(name) / "vae").to(device, dtype).eval()
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    shape = (1, channels, 1, 8, 8) if rank == 5 else (1, channels, 8, 8)
    return vae, torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)


# Tracing costs seconds a VAE on the CPU CI machine: one decoder here, every family's on CUDA (below).
@pytest.mark.parametrize("name", ["qwen-image-2.1"])
def test_decoder_traces_whole_and_decodes_as_eager(name):
    vae, latents = tiny_vae(name)
    with torch.inference_mode():
        want = vae.decode(latents, return_dict=False)[0]
        # Dynamo's graph run by the eager backend: what Inductor would compile, with no graph break allowed.
        forward = accelerate_decoder(vae, backend="eager", fullgraph=True)
        got = vae.decode(latents, return_dict=False)[0]
        assert forward.compiles == 1  # counted by the decoder's hooks around diffusers' call
        vae.decode(latents, return_dict=False)
    assert compiled_forward(vae.decoder) is forward and forward.runner is None and forward.compiles == 1
    assert "forward" not in vars(vae.decoder)  # compiled by `nn.Module.compile`, the class forward runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if all(p.dim() < 5 for p in vae.decoder.parameters()):
        convs = [m for m in vae.decoder.modules() if isinstance(m, nn.Conv2d)]
        assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)


class _Pipeline(nn.Module):
    compile_vae_decoder = True

    def __init__(self, vae: nn.Module, compiled_dit: bool):
        super().__init__()
        self.vae = vae
        self.transformer = nn.Linear(2, 2)
        if compiled_dit:
            accelerate_transformer(self.transformer, compile_blocks=False, cuda_graphs=False)


def test_decoder_compiled_only_beside_a_compiled_dit():
    vae, _ = tiny_vae("flux2-klein")
    config = OmniDiffusionConfig(model="tiny")
    assert not accelerate_vae_if_requested(_Pipeline(vae, compiled_dit=False), config)  # eager / CPU stage
    assert not accelerate_vae_if_requested(_Pipeline(vae, compiled_dit=True),
                                           OmniDiffusionConfig(model="tiny", enable_cpu_offload=True))
    assert compiled_forward(vae.decoder) is None
    assert accelerate_vae_if_requested(_Pipeline(vae, compiled_dit=True), config)
    assert compiled_forward(vae.decoder) is not None


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(FAMILY_VAES))
def test_inductor_decoder_keeps_the_image_on_cuda(name):
    vae, latents = tiny_vae(name, "cuda", torch.bfloat16)
    batch = torch.cat([latents, latents])
    with torch.inference_mode():
        want = vae.decode(batch, return_dict=False)[0].float()
        accelerate_decoder(vae, fullgraph=True)
        vae.decode(latents, return_dict=False)
        got = vae.decode(batch, return_dict=False)[0].float()
    assert vae.decoder.compiled_forward.compiles == 2  # batch 1 static, then one graph with a symbolic batch
    mse = torch.mean((got - want) ** 2).item()
    assert mse == 0 or 10 * math.log10(4.0 / mse) >= 40  # images in [-1, 1]
