"""What each rank runs in the VAE patch-parallel tests (importable by name for the spawned ranks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def decode_latents(model_dir: str, latent_shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """Random latents through the checkpoint's VAE: the patch-parallel decode on this rank's VAE group (or
    `vae.decode` when it has one rank), with the strip / halo sizes it used."""
    from pathlib import Path

    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    from vllm_omni.diffusion.distributed.vae_patch import (
        patch_parallel_decode,
        strip_bounds,
        up_path_halo,
        vae_patch_group,
    )

    name = next(cls for cls in ("AutoencoderKLQwenImage", "AutoencoderKLWan")
                if cls in (Path(model_dir) / "vae" / "config.json").read_text())
    vae_cls = AutoencoderKLQwenImage if name == "AutoencoderKLQwenImage" else AutoencoderKLWan
    vae = vae_cls.from_pretrained(model_dir, subfolder="vae", torch_dtype=torch.float32).eval()
    latents = torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed))
    group = vae_patch_group()
    with torch.inference_mode():
        if group is None:
            out = vae.decode(latents, return_dict=False)[0]
        elif getattr(vae.config, "patch_size", None):  # Wan2.2's VAE: the pipeline's streaming path
            from vllm_omni.models.wan.vae_stream import WanVaeStream

            with WanVaeStream(vae, latents, group=group) as stream:
                out = torch.cat(list(stream), dim=2)
        else:
            out = patch_parallel_decode(vae, latents, group)
    size = 1 if group is None else group.world_size
    longest = max(b - a for a, b in strip_bounds(latent_shape[-2], size))
    return {"output": out.double().numpy(), "halo": up_path_halo(vae.decoder), "strip_rows": longest,
            "latent_rows": latent_shape[-2]}


def as_array(result: dict[str, Any]) -> np.ndarray:
    return np.asarray(result["output"], dtype=np.float64)
