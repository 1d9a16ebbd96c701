"""LTX-2's joint audio-video DiT with tensor-parallel linears and our attention layer.

Parameter names are diffusers' `LTX2VideoTransformer3DModel`'s, so the sharded `transformer/` of the
Lightricks/LTX-2 repo loads by name. The math is the diffusers model's (LTX-2.0: no gated attention, no prompt
adaLN, no perturbed attention): per block, video and audio self-attention, cross-attention of each stream to its
text tokens, audio-to-video and video-to-audio cross-attention (queries of one stream, keys and values of the
other, both rotated by their time positions), then each stream's MLP; adaLN everywhere from global timestep
embeddings plus per-block tables. q/k are RMS-normed across all heads (`HeadShardedRMSNorm` under TP) and
rotated by per-head frequency tables (the head split of the rotary tables follows the local heads).

The pipeline keeps a sample's video and audio latents as one flat row, so `forward` takes and returns flat rows;
the `cache` argument (`vllm_omni/diffusion/cache`) either runs the whole joint forward or reuses the residual it
left at the last computed step, decided on the change of the video timestep embedding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import PixArtAlphaTextProjection
from diffusers.models.transformers.transformer_ltx2 import LTX2AdaLayerNormSingle, LTX2AudioVideoRotaryPosEmbed
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.layers.norm import HeadShardedRMSNorm
from vllm_omni.diffusion.model_loader.weight_utils import default_weight_loader
from vllm_omni.models.qwen_image.transformer import FeedForward

RopeTables = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) float32 per rotated channel pair: (tokens, pairs) for `interleaved` RoPE (adjacent channels
pair up), (tokens, groups, pairs per group) for `split` RoPE (each group's first half pairs with its second)."""
QK_NORM_EPS = 1e-6
"""diffusers builds every `LTX2Attention` with its default q/k norm eps, whatever `norm_eps` says."""


@dataclass(frozen=True)
class LTX2TransformerConfig:
    """The fields of diffusers' `transformer/config.json` (same names and defaults: the real LTX-2 sizes)."""

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "vae_scale_factors", tuple(self.vae_scale_factors))
        object.__setattr__(self, "out_channels", self.out_channels or self.in_channels)
        object.__setattr__(self, "audio_out_channels", self.audio_out_channels or self.audio_in_channels)
        # Later LTX-2.x variants (gated attention, prompt adaLN, STG, keyframes) are other models: refuse loudly.
        wanted = dict(gated_attn=False, cross_attn_mod=False, audio_gated_attn=False, audio_cross_attn_mod=False,
                      perturbed_attn=False, use_prompt_embeddings=True, use_keyframes_abs_pos_embedding=False,
                      norm_elementwise_affine=False, qk_norm="rms_norm_across_heads",
                      activation_fn="gelu-approximate", attention_bias=True, attention_out_bias=True, ff_bias=True,
                      audio_ff_bias=True, patch_size=1, patch_size_t=1, audio_patch_size=1, audio_patch_size_t=1)
        unsupported = {k: getattr(self, k) for k, v in wanted.items() if getattr(self, k) != v}
        if unsupported:
            raise NotImplementedError(f"LTX-2 transformer: unsupported config {unsupported} (LTX-2.0 only)")
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"LTX-2 transformer: rope_type={self.rope_type!r} (interleaved or split)")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> LTX2TransformerConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in raw if k not in names and not k.startswith("_"))
        if unknown:
            raise ValueError(f"unsupported LTX2VideoTransformer3DModel config keys: {unknown}")
        return cls(**{k: v for k, v in raw.items() if k in names})


def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight, statistics in fp32 (diffusers' `RMSNorm(elementwise_affine=False)`)."""
    return (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-block table (n, dim) + global embedding (batch, tokens or 1, n * dim) -> n (batch, tokens or 1, dim)."""
    return (table[None, None] + temb.unflatten(-1, (table.shape[0], -1))).unbind(2)


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate `x` (batch, tokens, channels) by per-pair tables (`RopeTables`; the table's rank tells the layout)."""
    cos, sin = rope
    if cos.ndim == 3:  # split: (groups, 2, pairs) channel blocks
        first, second = x.float().unflatten(-1, (cos.shape[1], 2, -1)).unbind(-2)
        out = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-2).flatten(-3)
    else:  # interleaved: adjacent (even, odd) channels
        first, second = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def _rope_tables(rope: LTX2AudioVideoRotaryPosEmbed, coords: torch.Tensor) -> RopeTables:
    """diffusers' tables for one sample's `coords`, as this TP rank's per-pair `RopeTables` (the channel slice
    of its heads: column-parallel q/k hold contiguous head blocks)."""
    cos, sin = rope(coords)
    if rope.rope_type == "split":  # (1, groups, tokens, pairs) -> (tokens, groups, pairs)
        cos, sin = cos[0].transpose(0, 1), sin[0].transpose(0, 1)
    else:  # (1, tokens, channels), each pair's value repeated
        cos, sin = cos[0, :, ::2], sin[0, :, ::2]
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    size = cos.shape[1] // tp
    return cos.narrow(1, rank * size, size).contiguous(), sin.narrow(1, rank * size, size).contiguous()


class LTX2Attention(nn.Module):
    """q from `x`, k/v from `context` (`x` itself for self-attention), q/k RMS-normed across heads, optional
    RoPE (separate key tables for the audio-video cross-attention), out projection."""

    def __init__(self, dim: int, context_dim: int, num_heads: int, head_dim: int, *, prefix: str,
                 attn_config: DiffusionAttentionConfig | None, cross_attention: bool) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = ColumnParallelLinear(dim, inner, bias=True, gather_output=False, return_bias=False,
                                         prefix=f"{prefix}.to_q")
        self.to_k = ColumnParallelLinear(context_dim, inner, bias=True, gather_output=False, return_bias=False,
                                         prefix=f"{prefix}.to_k")
        self.to_v = ColumnParallelLinear(context_dim, inner, bias=True, gather_output=False, return_bias=False,
                                         prefix=f"{prefix}.to_v")
        self.norm_q = HeadShardedRMSNorm(inner, QK_NORM_EPS)
        self.norm_k = HeadShardedRMSNorm(inner, QK_NORM_EPS)
        self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, bias=True, input_is_parallel=True,
                                                       return_bias=False, prefix=f"{prefix}.to_out.0")])
        self.attn = Attention(num_heads // get_tensor_model_parallel_world_size(), head_dim, prefix=f"{prefix}.attn",
                              attn_config=attn_config, cross_attention=cross_attention)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                rope: RopeTables | None = None, key_rope: RopeTables | None = None) -> torch.Tensor:
        context = x if context is None else context
        query, key, value = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(context)), self.to_v(context)
        if rope is not None:
            query, key = apply_rope(query, rope), apply_rope(key, rope if key_rope is None else key_rope)
        heads = (-1, self.head_dim)
        out = self.attn(query.unflatten(-1, heads), key.unflatten(-1, heads), value.unflatten(-1, heads),
                        attn_mask=mask)
        return self.to_out[0](out.flatten(2).type_as(query))


@dataclass
class LTX2Conditions:
    """What every block reads besides the two streams (computed once per forward)."""

    text: torch.Tensor
    audio_text: torch.Tensor
    text_mask: torch.Tensor | None
    """(batch, text tokens) bool, True = real; None when every token is real."""
    temb: torch.Tensor
    """Video adaLN (batch, video tokens or 1, 6 * dim)."""
    audio_temb: torch.Tensor
    av_video: torch.Tensor
    """Audio-video cross-attention scale/shift of the video side (batch, 1, 4 * dim)."""
    av_audio: torch.Tensor
    a2v_gate: torch.Tensor
    v2a_gate: torch.Tensor
    video_rope: RopeTables
    audio_rope: RopeTables
    cross_video_rope: RopeTables
    cross_audio_rope: RopeTables


class LTX2TransformerBlock(nn.Module):
    def __init__(self, config: LTX2TransformerConfig, prefix: str = "",
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        dim, audio_dim = config.inner_dim, config.audio_inner_dim
        heads, head_dim = config.num_attention_heads, config.attention_head_dim
        audio_heads, audio_head_dim = config.audio_num_attention_heads, config.audio_attention_head_dim
        self.eps = config.norm_eps

        def attention(name: str, q_dim: int, kv_dim: int, num_heads: int, hd: int, cross: bool) -> LTX2Attention:
            return LTX2Attention(q_dim, kv_dim, num_heads, hd, prefix=f"{prefix}.{name}", attn_config=attn_config,
                                 cross_attention=cross)

        self.attn1 = attention("attn1", dim, dim, heads, head_dim, False)
        self.audio_attn1 = attention("audio_attn1", audio_dim, audio_dim, audio_heads, audio_head_dim, False)
        self.attn2 = attention("attn2", dim, config.cross_attention_dim, heads, head_dim, True)
        self.audio_attn2 = attention("audio_attn2", audio_dim, config.audio_cross_attention_dim, audio_heads,
                                     audio_head_dim, True)
        self.audio_to_video_attn = attention("audio_to_video_attn", dim, audio_dim, audio_heads, audio_head_dim,
                                             True)
        self.video_to_audio_attn = attention("video_to_audio_attn", audio_dim, dim, audio_heads, audio_head_dim,
                                             True)
        self.ff = FeedForward(dim, prefix=f"{prefix}.ff")
        self.audio_ff = FeedForward(audio_dim, prefix=f"{prefix}.audio_ff")
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(6, audio_dim) / audio_dim**0.5)
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, audio_dim))

    def forward(self, video: torch.Tensor, audio: torch.Tensor, c: LTX2Conditions
                ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.eps
        shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = _modulation(self.scale_shift_table, c.temb)
        a_shift, a_scale, a_gate, a_mlp_shift, a_mlp_scale, a_mlp_gate = _modulation(
            self.audio_scale_shift_table, c.audio_temb)
        # 1. self-attention of each stream
        video = video + self.attn1(_rms_norm(video, eps) * (1 + scale) + shift, rope=c.video_rope) * gate
        audio = audio + self.audio_attn1(_rms_norm(audio, eps) * (1 + a_scale) + a_shift, rope=c.audio_rope) * a_gate
        # 2. each stream to its text tokens
        video = video + self.attn2(_rms_norm(video, eps), c.text, mask=c.text_mask)
        audio = audio + self.audio_attn2(_rms_norm(audio, eps), c.audio_text, mask=c.text_mask)
        # 3. audio -> video and video -> audio, both from the streams as they leave step 2
        norm_video, norm_audio = _rms_norm(video, eps), _rms_norm(audio, eps)
        v_table, a_table = self.video_a2v_cross_attn_scale_shift_table, self.audio_a2v_cross_attn_scale_shift_table
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = _modulation(v_table[:4], c.av_video)
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = _modulation(a_table[:4], c.av_audio)
        (a2v_gate,), (v2a_gate,) = _modulation(v_table[4:], c.a2v_gate), _modulation(a_table[4:], c.v2a_gate)
        a2v = self.audio_to_video_attn(norm_video * (1 + v_a2v_scale) + v_a2v_shift,
                                       norm_audio * (1 + a_a2v_scale) + a_a2v_shift,
                                       rope=c.cross_video_rope, key_rope=c.cross_audio_rope)
        v2a = self.video_to_audio_attn(norm_audio * (1 + a_v2a_scale) + a_v2a_shift,
                                       norm_video * (1 + v_v2a_scale) + v_v2a_shift,
                                       rope=c.cross_audio_rope, key_rope=c.cross_video_rope)
        video, audio = video + a2v_gate * a2v, audio + v2a_gate * v2a
        # 4. MLPs
        video = video + self.ff(_rms_norm(video, eps) * (1 + mlp_scale) + mlp_shift) * mlp_gate
        audio = audio + self.audio_ff(_rms_norm(audio, eps) * (1 + a_mlp_scale) + a_mlp_shift) * a_mlp_gate
        return video, audio


class LTX2VideoTransformer3DModel(nn.Module):
    """Predicts the flow of a sample's video and audio latents, jointly (see the module docstring)."""

    _no_split_modules = ["LTX2TransformerBlock"]
    _repeated_blocks = ["LTX2TransformerBlock"]
    _sp_plan: ClassVar[None] = None
    """No sequence parallelism (`distributed/sequence_plan.py` refuses it at build): not implemented for its joint
    video and audio streams."""

    def __init__(self, config: LTX2TransformerConfig, prefix: str = "",
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.audio_num_attention_heads % tp:
            raise ValueError(f"LTX-2 transformer: tensor-parallel size {tp} must divide the video and audio heads "
                             f"({config.num_attention_heads}, {config.audio_num_attention_heads})")
        self.config = config
        dim, audio_dim = config.inner_dim, config.audio_inner_dim
        self.proj_in = ReplicatedLinear(config.in_channels, dim, bias=True, return_bias=False,
                                        prefix=f"{prefix}proj_in")
        self.audio_proj_in = ReplicatedLinear(config.audio_in_channels, audio_dim, bias=True, return_bias=False,
                                              prefix=f"{prefix}audio_proj_in")
        self.caption_projection = PixArtAlphaTextProjection(config.caption_channels, dim)
        self.audio_caption_projection = PixArtAlphaTextProjection(config.caption_channels, audio_dim)
        self.time_embed = LTX2AdaLayerNormSingle(dim, num_mod_params=6)
        self.audio_time_embed = LTX2AdaLayerNormSingle(audio_dim, num_mod_params=6)
        self.av_cross_attn_video_scale_shift = LTX2AdaLayerNormSingle(dim, num_mod_params=4)
        self.av_cross_attn_audio_scale_shift = LTX2AdaLayerNormSingle(audio_dim, num_mod_params=4)
        self.av_cross_attn_video_a2v_gate = LTX2AdaLayerNormSingle(dim, num_mod_params=1)
        self.av_cross_attn_audio_v2a_gate = LTX2AdaLayerNormSingle(audio_dim, num_mod_params=1)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(2, audio_dim) / audio_dim**0.5)
        # Position tables: diffusers' own RoPE modules (no parameters), read as per-pair tables.
        rope = dict(theta=config.rope_theta, causal_offset=config.causal_offset,
                    double_precision=config.rope_double_precision, rope_type=config.rope_type)
        video_axes = dict(base_height=config.base_height, base_width=config.base_width, modality="video")
        audio_axes = dict(sampling_rate=config.audio_sampling_rate, hop_length=config.audio_hop_length,
                          modality="audio")
        cross_max_pos = max(config.pos_embed_max_pos, config.audio_pos_embed_max_pos)
        self.rope = LTX2AudioVideoRotaryPosEmbed(
            dim, base_num_frames=config.pos_embed_max_pos, scale_factors=config.vae_scale_factors,
            num_attention_heads=config.num_attention_heads, **video_axes, **rope)
        self.audio_rope = LTX2AudioVideoRotaryPosEmbed(
            audio_dim, base_num_frames=config.audio_pos_embed_max_pos, scale_factors=[config.audio_scale_factor],
            num_attention_heads=config.audio_num_attention_heads, **audio_axes, **rope)
        self.cross_attn_rope = LTX2AudioVideoRotaryPosEmbed(
            config.audio_cross_attention_dim, base_num_frames=cross_max_pos, scale_factors=config.vae_scale_factors,
            num_attention_heads=config.num_attention_heads, **video_axes, **rope)
        self.cross_attn_audio_rope = LTX2AudioVideoRotaryPosEmbed(
            config.audio_cross_attention_dim, base_num_frames=cross_max_pos,
            num_attention_heads=config.audio_num_attention_heads, **audio_axes, **rope)
        self.transformer_blocks = nn.ModuleList(
            LTX2TransformerBlock(config, prefix=f"{prefix}transformer_blocks.{i}", attn_config=attn_config)
            for i in range(config.num_layers))
        self.proj_out = ReplicatedLinear(dim, config.out_channels, bias=True, return_bias=False,
                                         prefix=f"{prefix}proj_out")
        self.audio_proj_out = ReplicatedLinear(audio_dim, config.audio_out_channels, bias=True, return_bias=False,
                                               prefix=f"{prefix}audio_proj_out")

    @classmethod
    def from_config(cls, config: dict, *, prefix: str = "",
                    attn_config: DiffusionAttentionConfig | None = None) -> LTX2VideoTransformer3DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        return cls(LTX2TransformerConfig.from_dict(config), prefix=prefix, attn_config=attn_config)

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        video_embeds: torch.Tensor,
        audio_embeds: torch.Tensor,
        text_mask: torch.Tensor | None,
        *,
        video_timestep: torch.Tensor | None = None,
        video_shape: tuple[int, int, int],
        audio_frames: int,
        fps: float,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """Flat rows in, flat rows out: `x` is (rows, video_tokens * C_video + audio_tokens * C_audio).
        `timestep` (rows,) conditions both streams (and, as in diffusers' LTX-2 pipelines, their cross-modal
        modulation); `video_timestep` (rows, video tokens), when given, the video tokens (image-to-video: 0 on the
        given first frame). `text_mask` (rows, text tokens) 1 where a connector token is real."""
        rows = x.shape[0]
        cfg = self.config
        split = math.prod(video_shape) * cfg.in_channels
        video = x[:, :split].view(rows, -1, cfg.in_channels)
        audio = x[:, split:].view(rows, audio_frames, cfg.audio_in_channels)

        def blocks() -> torch.Tensor:
            video_out, audio_out = self.forward_streams(video, audio, timestep, video_embeds, audio_embeds,
                                                        text_mask, video_timestep, video_shape, audio_frames, fps)
            return torch.cat([video_out.flatten(1), audio_out.flatten(1)], dim=1)

        if cache is None:
            return blocks()

        def probe() -> torch.Tensor:
            return self.time_embed(timestep.flatten(), batch_size=rows, hidden_dtype=x.dtype)[0]

        return cache.run(x, blocks, probe, num_blocks=len(self.transformer_blocks))

    def forward_streams(self, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                        video_embeds: torch.Tensor, audio_embeds: torch.Tensor, text_mask: torch.Tensor | None,
                        video_timestep: torch.Tensor | None, video_shape: tuple[int, int, int], audio_frames: int,
                        fps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, video tokens, C) and (rows, audio tokens, C) latents -> their predicted flows."""
        rows = video.shape[0]
        video, audio = self.proj_in(video), self.audio_proj_in(audio)

        def embed(module: LTX2AdaLayerNormSingle, t: torch.Tensor, like: torch.Tensor):
            mod, emb = module(t.flatten(), batch_size=rows, hidden_dtype=like.dtype)
            return mod.view(rows, -1, mod.shape[-1]), emb.view(rows, -1, emb.shape[-1])

        temb, video_emb = embed(self.time_embed, timestep if video_timestep is None else video_timestep, video)
        audio_temb, audio_emb = embed(self.audio_time_embed, timestep, audio)
        gate_t = timestep * (self.config.cross_attn_timestep_scale_multiplier / self.config.timestep_scale_multiplier)
        if text_mask is not None:
            text_mask = None if bool(text_mask.all()) else text_mask.bool()
        conditions = LTX2Conditions(
            text=self.caption_projection(video_embeds),
            audio_text=self.audio_caption_projection(audio_embeds),
            text_mask=text_mask,
            temb=temb,
            audio_temb=audio_temb,
            av_video=embed(self.av_cross_attn_video_scale_shift, timestep, video)[0],
            av_audio=embed(self.av_cross_attn_audio_scale_shift, timestep, audio)[0],
            a2v_gate=embed(self.av_cross_attn_video_a2v_gate, gate_t, video)[0],
            v2a_gate=embed(self.av_cross_attn_audio_v2a_gate, gate_t, audio)[0],
            **self.rope_tables(video_shape, audio_frames, fps, video.device),
        )
        for block in self.transformer_blocks:
            video, audio = block(video, audio, conditions)
        shift, scale = (self.scale_shift_table[None, None] + video_emb[:, :, None]).unbind(2)
        video = self.proj_out(F.layer_norm(video, video.shape[-1:], eps=1e-6) * (1 + scale) + shift)
        shift, scale = (self.audio_scale_shift_table[None, None] + audio_emb[:, :, None]).unbind(2)
        audio = self.audio_proj_out(F.layer_norm(audio, audio.shape[-1:], eps=1e-6) * (1 + scale) + shift)
        return video, audio

    def rope_tables(self, video_shape: tuple[int, int, int], audio_frames: int, fps: float,
                    device: torch.device) -> dict[str, RopeTables]:
        """Self- and cross-attention RoPE tables of one sample (every row shares its geometry)."""
        video_coords = self.rope.prepare_video_coords(1, *video_shape, device, fps=fps)
        audio_coords = self.audio_rope.prepare_audio_coords(1, audio_frames, device)
        return dict(
            video_rope=_rope_tables(self.rope, video_coords),
            audio_rope=_rope_tables(self.audio_rope, audio_coords),
            cross_video_rope=_rope_tables(self.cross_attn_rope, video_coords[:, 0:1]),
            cross_audio_rope=_rope_tables(self.cross_attn_audio_rope, audio_coords[:, 0:1]),
        )

    def lora_target(self, module: str) -> tuple[str, None]:
        """Our linear computing diffusers module `module` (a LoRA target): the same name, no projection fused."""
        return module, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors (sharding TP slices); returns the names of the parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
