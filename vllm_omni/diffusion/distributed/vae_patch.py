"""VAE patch-parallel decode for the Wan-style causal 3D VAE (diffusers' `AutoencoderKLWan`, and
`AutoencoderKLQwenImage`, which has the same decoder).

The decoder's mid block attends over the whole latent frame, so spatial tiles of the latent do not decode
exactly (diffusers' `tiled_decode` blends tiles that each saw a different attention context). Everything after
the mid block is local: causal convolutions, channel RMS norms, nearest upsampling. So every rank of the VAE
patch group runs `conv_in` and the mid block on the whole (small) latent frame, then the up path (where almost
all of the decoder's work is) on its own row strip plus a halo that covers the up path's receptive field, crops
the halo off, and the strips are all-gathered into the frame. Frames go one at a time as in diffusers' `_decode`,
each strip keeping its own causal feature cache, so strips are spatial only and each covers every frame. Output
equals the single-rank decode up to float rounding.

diffusers has no public hook between the mid block and the up blocks, so `decode_frame` walks the decoder's own
modules in `WanDecoder3d.forward` / `QwenImageDecoder3d.forward` order (the causal-cache convention of their
`conv_in` / `conv_out` included); the modules themselves are diffusers'.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

_CACHE_T = 2
"""Frames a causal conv keeps for the next call (diffusers' CACHE_T)."""


def vae_patch_group() -> GroupCoordinator | None:
    """The VAE patch group of this rank, or None when the decode is not split."""
    groups = get_diffusion_groups()
    return None if groups is None or groups.vae.world_size == 1 else groups.vae


def up_path_halo(decoder: nn.Module) -> int:
    """Latent rows of context one output row needs beyond its own: the receptive radius of the up blocks and
    `conv_out`, each conv's spatial radius counted at the resolution it runs at (registration order is
    execution order in both decoders: resnets, then the upsampler's nearest-upsample and conv), plus one
    coarse pixel per upsample for the rounding of nearest neighbours."""
    radius, scale = 0.0, 1.0
    for module in [*decoder.up_blocks.modules(), decoder.conv_out]:
        if isinstance(module, nn.Upsample):
            radius += 1 / scale
            scale *= float(torch.tensor(module.scale_factor).flatten()[-1])
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
            radius += (module.kernel_size[-1] // 2) * module.dilation[-1] / scale
    return math.ceil(radius) + 1


def strip_bounds(height: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous row ranges covering `height` latent rows (sizes differ by at most one)."""
    cuts = [round(i * height / parts) for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _cached_conv(conv: nn.Module, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
    """A causal conv with diffusers' feature-cache convention (the last `_CACHE_T` input frames are kept)."""
    i = idx[0]
    keep = x[:, :, -_CACHE_T:].clone()
    if keep.shape[2] < 2 and cache[i] is not None:
        keep = torch.cat([cache[i][:, :, -1:].to(keep.device), keep], dim=2)
    out = conv(x, cache[i])
    cache[i] = keep
    idx[0] += 1
    return out


class PatchParallelDecoder:
    """One decode of a clip through `vae.decoder`, split in row strips over `group` (call it frame by frame on
    the output of `vae.post_quant_conv`); every rank gets the whole decoded frame."""

    def __init__(self, vae: nn.Module, group: GroupCoordinator) -> None:
        self.decoder = vae.decoder
        self.group = group
        self.halo = up_path_halo(self.decoder)
        self._first_chunk = "first_chunk" in inspect.signature(self.decoder.up_blocks[0].forward).parameters
        num_convs = sum(isinstance(m, nn.Conv3d) for m in self.decoder.modules())  # >= the cache slots used
        self._shared: list = [None] * num_convs
        """Cache of `conv_in` and the mid block (whole frame)."""
        self._strip: list = [None] * num_convs
        """Cache of this rank's up path (its strip with halo)."""

    def decode_frame(self, x: torch.Tensor, first_chunk: bool = False) -> torch.Tensor:
        """(B, C, t, h, w) latents of one step of the causal loop -> the decoder's output for the whole frame."""
        dec, idx = self.decoder, [0]
        x = _cached_conv(dec.conv_in, x, self._shared, idx)
        x = dec.mid_block(x, self._shared, idx)
        height, rank, size = x.shape[-2], self.group.rank_in_group, self.group.world_size
        bounds = strip_bounds(height, size)
        start, stop = bounds[rank]
        lo, hi = max(0, start - self.halo), min(height, stop + self.halo)
        y = x[..., lo:hi, :]
        kwargs = {"first_chunk": first_chunk} if self._first_chunk else {}
        for block in dec.up_blocks:
            y = block(y, self._strip, idx, **kwargs)
        y = _cached_conv(dec.conv_out, dec.nonlinearity(dec.norm_out(y)), self._strip, idx)
        factor = y.shape[-2] // (hi - lo)
        y = y[..., (start - lo) * factor:(stop - lo) * factor, :]
        rows = max(b - a for a, b in bounds) * factor
        gathered = self.group.all_gather(F.pad(y, (0, 0, 0, rows - y.shape[-2])).contiguous(), dim=-2)
        parts = gathered.split(rows, dim=-2)
        return torch.cat([part[..., :(b - a) * factor, :] for part, (a, b) in zip(parts, bounds, strict=True)],
                         dim=-2)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Continue with batch rows `rows` only (an aborted request left between frames)."""
        for cache in (self._shared, self._strip):
            cache[:] = [f.index_select(0, rows) if isinstance(f, torch.Tensor) else f for f in cache]


def patch_parallel_decode(vae: nn.Module, latents: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """`vae.decode(latents).sample` (clamped to [-1, 1]) with the up path split over `group` (Qwen-Image)."""
    x = vae.post_quant_conv(latents)
    decoder = PatchParallelDecoder(vae, group)
    frames = [decoder.decode_frame(x[:, :, i:i + 1], first_chunk=i == 0) for i in range(x.shape[2])]
    return torch.cat(frames, dim=2).clamp(-1.0, 1.0)
