"""Streaming decode of Wan latents through diffusers' `AutoencoderKLWan`, a few latent frames at a time.

The Wan VAE decoder is causal over time: diffusers' `AutoencoderKLWan._decode` already runs it one latent frame
per call with a feature cache, but only returns the whole clip. diffusers (0.42) has no public per-frame or
streaming decode, so this walks the same loop on the VAE's own cache (`clear_cache`, `_feat_map`, `_conv_idx`,
`decoder(..., feat_cache=, feat_idx=, first_chunk=)`) and yields after every chunk: the first pixels are ready
early and the concatenation equals `vae.decode(latents)` exactly (same ops, same order). Tiling
(`enable_tiling`) is not applied here; under VAE patch parallel (`group`) each frame's up path is split in row
strips over the group's ranks (`diffusion/distributed/vae_patch.py`) and every rank gets the whole chunk.
The first latent frame gives 1 video frame, every later one `scale_factor_temporal` frames.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Self

import torch

from vllm_omni.diffusion.distributed.vae_patch import PatchParallelDecoder

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan
    from vllm.distributed.parallel_state import GroupCoordinator


class WanVaeStream:
    """`with WanVaeStream(vae, latents) as stream: for pixels in stream: ...`: pixels (B, 3, t, H, W) in [-1, 1].

    Between chunks `keep_rows` may drop batch rows (an aborted request): the rest decode on unchanged.
    """

    def __init__(self, vae: AutoencoderKLWan, latents: torch.Tensor, chunk_latent_frames: int = 1,
                 group: GroupCoordinator | None = None) -> None:
        if chunk_latent_frames < 1:
            raise ValueError(f"chunk_latent_frames must be >= 1, got {chunk_latent_frames}")
        self.vae = vae
        self.latents = latents
        self.chunk_latent_frames = chunk_latent_frames
        self.group = group
        self._x: torch.Tensor | None = None
        self._patch: PatchParallelDecoder | None = None

    def __enter__(self) -> Self:
        self.vae.clear_cache()
        self._x = self.vae.post_quant_conv(self.latents)
        self._patch = None if self.group is None else PatchParallelDecoder(self.vae, self.group)
        return self

    def __exit__(self, *exc: object) -> None:
        self._x = self._patch = None
        self.vae.clear_cache()

    def __iter__(self) -> Iterator[torch.Tensor]:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        if self._x is None:
            raise RuntimeError("WanVaeStream is iterated inside its `with` block")
        num_frames = self._x.shape[2]
        for start in range(0, num_frames, self.chunk_latent_frames):
            outs = []
            for i in range(start, min(start + self.chunk_latent_frames, num_frames)):
                if self._patch is not None:
                    outs.append(self._patch.decode_frame(self._x[:, :, i:i + 1], first_chunk=i == 0))
                    continue
                self.vae._conv_idx = [0]
                outs.append(self.vae.decoder(self._x[:, :, i:i + 1], feat_cache=self.vae._feat_map,
                                             feat_idx=self.vae._conv_idx, first_chunk=i == 0))
            out = torch.cat(outs, dim=2)
            if self.vae.config.patch_size is not None:
                out = unpatchify(out, patch_size=self.vae.config.patch_size)
            yield out.clamp(-1.0, 1.0)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Continue with batch rows `rows` only: of the latents still to decode and of every cached feature."""
        self._x = self._x.index_select(0, rows)
        self.vae._feat_map = [f.index_select(0, rows) if isinstance(f, torch.Tensor) else f
                              for f in self.vae._feat_map]
        if self._patch is not None:
            self._patch.keep_rows(rows)
