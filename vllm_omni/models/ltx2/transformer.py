"""LTX-2's audio-video DiT: diffusers' `LTX2VideoTransformer3DModel` with the cache hook of our step contract.

The blocks, RoPE, adaLN and attention are diffusers' own. What this adds is the `cache` argument
(`vllm_omni/diffusion/cache`): the pipeline keeps video and audio latents as one flat row per sample, and a
TeaCache step either runs the whole joint forward or reuses the (video, audio) residual it left at the last
computed step, decided on the change of the video timestep embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2VideoTransformer3DModel


class LTX2Transformer(LTX2VideoTransformer3DModel):
    """Flat rows in, flat rows out: `x` is (rows, video_tokens * C_video + audio_tokens * C_audio). `timestep`
    (rows,) conditions both streams; `video_timestep` (rows, video tokens), when given, the video tokens
    (image-to-video: 0 on the given first frame)."""

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        video_embeds: torch.Tensor,
        audio_embeds: torch.Tensor,
        text_mask: torch.Tensor,
        *,
        video_timestep: torch.Tensor | None = None,
        video_shape: tuple[int, int, int],
        audio_frames: int,
        fps: float,
        cache: Any = None,
    ) -> torch.Tensor:
        rows = x.shape[0]
        video_tokens = video_shape[0] * video_shape[1] * video_shape[2]
        split = video_tokens * self.config.in_channels
        video = x[:, :split].view(rows, video_tokens, self.config.in_channels)
        audio = x[:, split:].view(rows, audio_frames, self.config.audio_in_channels)

        def blocks() -> torch.Tensor:
            video_out, audio_out = super(LTX2Transformer, self).forward(
                hidden_states=video,
                audio_hidden_states=audio,
                encoder_hidden_states=video_embeds,
                audio_encoder_hidden_states=audio_embeds,
                timestep=timestep if video_timestep is None else video_timestep,
                audio_timestep=timestep,
                sigma=timestep,
                encoder_attention_mask=text_mask,
                audio_encoder_attention_mask=text_mask,
                num_frames=video_shape[0],
                height=video_shape[1],
                width=video_shape[2],
                fps=fps,
                audio_num_frames=audio_frames,
                use_cross_timestep=True,
                return_dict=False,
            )
            return torch.cat([video_out.flatten(1), audio_out.flatten(1)], dim=1)

        if cache is None:
            return blocks()

        def probe() -> torch.Tensor:
            return self.time_embed(timestep.flatten(), batch_size=rows, hidden_dtype=x.dtype)[0]

        return cache.run(x, blocks, probe, num_blocks=len(self.transformer_blocks))
