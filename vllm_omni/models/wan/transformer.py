"""Wan 2.1 / 2.2 video DiT with tensor-parallel linears and our attention layer.

Parameter names follow diffusers' `WanTransformer3DModel` (after `_WEIGHT_RENAMES`), so the sharded
`transformer/diffusion_pytorch_model-*.safetensors` of the Wan-AI/*-Diffusers repos load by name. The math is
the diffusers model's: modulation and norms in fp32, 3D RoPE over (frame, height, width), cross-attention
to the text tokens plus (I2V) a separate attention to the CLIP image tokens whose result is added.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import (
    PixArtAlphaTextProjection,
    TimestepEmbedding,
    Timesteps,
    get_1d_rotary_pos_embed,
)
from diffusers.models.normalization import FP32LayerNorm
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.distributed.sequence_plan import AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.norm import HeadShardedRMSNorm
from vllm_omni.diffusion.model_loader.weight_utils import default_weight_loader

# diffusers name -> ours (substring replacements; diffusers keeps Dropout/activation slots in its ModuleLists).
_WEIGHT_RENAMES = ((".to_out.0.", ".to_out."), (".ffn.net.0.proj.", ".ffn.up."), (".ffn.net.2.", ".ffn.down."))


def _rename(name: str) -> str:
    for old, new in _WEIGHT_RENAMES:
        name = name.replace(old, new)
    return name


@dataclass(frozen=True)
class WanTransformerConfig:
    """The fields of diffusers' `transformer/config.json` that shape the model (defaults: Wan2.1 14B)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"Wan transformer: qk_norm={self.qk_norm!r} is not supported (rms_norm_across_heads)")
        if self.pos_embed_seq_len is not None:
            raise ValueError("Wan transformer: pos_embed_seq_len (FLF2V image position embedding) is not supported")
        object.__setattr__(self, "patch_size", tuple(self.patch_size))

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> WanTransformerConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @classmethod
    def from_json(cls, path: Path) -> WanTransformerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


class WanAttention(nn.Module):
    """Self- or cross-attention; `added_kv_proj_dim` adds the I2V image-token branch."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float, *, added_kv_proj_dim: int | None = None,
                 prefix: str = "", attn_config: DiffusionAttentionConfig | None = None,
                 cross_attention: bool = False) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = ColumnParallelLinear(dim, inner, bias=True, gather_output=False, prefix=f"{prefix}.to_q")
        self.to_k = ColumnParallelLinear(dim, inner, bias=True, gather_output=False, prefix=f"{prefix}.to_k")
        self.to_v = ColumnParallelLinear(dim, inner, bias=True, gather_output=False, prefix=f"{prefix}.to_v")
        self.to_out = RowParallelLinear(inner, dim, bias=True, input_is_parallel=True, prefix=f"{prefix}.to_out")
        self.norm_q = HeadShardedRMSNorm(inner, eps)
        self.norm_k = HeadShardedRMSNorm(inner, eps)
        self.num_local_heads = num_heads // get_tensor_model_parallel_world_size()
        self.attn = Attention(self.num_local_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config,
                              cross_attention=cross_attention)
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = ColumnParallelLinear(added_kv_proj_dim, inner, bias=True, gather_output=False,
                                                   prefix=f"{prefix}.add_k_proj")
            self.add_v_proj = ColumnParallelLinear(added_kv_proj_dim, inner, bias=True, gather_output=False,
                                                   prefix=f"{prefix}.add_v_proj")
            self.norm_added_k = HeadShardedRMSNorm(inner, eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_local_heads, self.head_dim))

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor | None = None,
                rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                image_context: torch.Tensor | None = None) -> torch.Tensor:
        context = hidden_states if context is None else context
        query = self._heads(self.norm_q(self.to_q(hidden_states)[0]))
        key = self._heads(self.norm_k(self.to_k(context)[0]))
        value = self._heads(self.to_v(context)[0])
        if rotary_emb is not None:
            query, key = apply_rotary_emb(query, *rotary_emb), apply_rotary_emb(key, *rotary_emb)
        out = self.attn(query, key, value).flatten(2)
        if image_context is not None and self.add_k_proj is not None:
            key_img = self._heads(self.norm_added_k(self.add_k_proj(image_context)[0]))
            value_img = self._heads(self.add_v_proj(image_context)[0])
            out = out + self.attn(query, key_img, value_img).flatten(2)
        return self.to_out(out.type_as(query))[0]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) channel pairs; x is (batch, seq, heads, head_dim), cos/sin (seq, head_dim/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class WanRotaryPosEmbed(nn.Module):
    """3D RoPE: the head dim is split into frame / height / width bands (t gets the remainder)."""

    def __init__(self, head_dim: int, patch_size: tuple[int, int, int], max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.patch_size = patch_size
        h_dim = w_dim = 2 * (head_dim // 6)
        self.split = (head_dim - h_dim - w_dim, h_dim, w_dim)
        cos, sin = [], []
        for dim in self.split:
            c, s = get_1d_rotary_pos_embed(dim, max_seq_len, theta, use_real=True, repeat_interleave_real=True,
                                           freqs_dtype=torch.float64)
            cos.append(c[:, ::2])  # repeat-interleaved pairs share one frequency: keep one per pair
            sin.append(s[:, ::2])
        self.register_buffer("freqs_cos", torch.cat(cos, dim=1).float(), persistent=False)
        self.register_buffer("freqs_sin", torch.cat(sin, dim=1).float(), persistent=False)

    def forward(self, num_frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        p_t, p_h, p_w = self.patch_size
        grid = (num_frames // p_t, height // p_h, width // p_w)
        bands = [d // 2 for d in self.split]
        out = []
        for table in (self.freqs_cos, self.freqs_sin):
            parts = table.split(bands, dim=1)
            axes = [
                parts[0][: grid[0]].view(grid[0], 1, 1, -1).expand(*grid, -1),
                parts[1][: grid[1]].view(1, grid[1], 1, -1).expand(*grid, -1),
                parts[2][: grid[2]].view(1, 1, grid[2], -1).expand(*grid, -1),
            ]
            out.append(torch.cat(axes, dim=-1).reshape(math.prod(grid), -1))
        return out[0], out[1]


class WanPatchEmbedding(nn.Conv3d):
    """The patchifying convolution, its output as tokens (batch, patches, dim): where the sequence-parallel plan
    splits them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).flatten(2).transpose(1, 2).contiguous()


class WanFeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.up = ColumnParallelLinear(dim, ffn_dim, bias=True, gather_output=False, prefix=f"{prefix}.up")
        self.down = RowParallelLinear(ffn_dim, dim, bias=True, input_is_parallel=True, prefix=f"{prefix}.down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)[0], approximate="tanh"))[0]


class WanTransformerBlock(nn.Module):
    def __init__(self, config: WanTransformerConfig, prefix: str = "",
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        dim, heads, head_dim, eps = config.inner_dim, config.num_attention_heads, config.attention_head_dim, config.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, head_dim, eps, prefix=f"{prefix}.attn1", attn_config=attn_config)
        self.attn2 = WanAttention(dim, heads, head_dim, eps, added_kv_proj_dim=config.added_kv_proj_dim,
                                  prefix=f"{prefix}.attn2", attn_config=attn_config, cross_attention=True)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        self.ffn = WanFeedForward(dim, config.ffn_dim, prefix=f"{prefix}.ffn")
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, context: torch.Tensor, image_context: torch.Tensor | None,
                temb: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # temb: (batch, 6, dim), or (batch, seq, 6, dim) with per-token timesteps (Wan2.2 TI2V).
        table = self.scale_shift_table if temb.ndim == 3 else self.scale_shift_table.unsqueeze(0)
        mods = [m.squeeze(-2) if temb.ndim == 4 else m for m in (table + temb.float()).chunk(6, dim=-2)]
        shift, scale, gate, c_shift, c_scale, c_gate = mods
        h = (self.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        x = (x.float() + self.attn1(h, rotary_emb=rotary_emb) * gate).type_as(x)
        h = self.norm2(x.float()).type_as(x)
        x = x + self.attn2(h, context, image_context=image_context)
        h = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.ffn(h).float() * c_gate).type_as(x)


class WanImageEmbedding(nn.Module):
    """Projects CLIP penultimate hidden states into the DiT width (weights named like diffusers')."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(in_features)
        self.ff = FeedForward(in_features, out_features, mult=1, activation_fn="gelu")
        self.norm2 = FP32LayerNorm(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.ff(self.norm1(x)))


class WanConditionEmbedder(nn.Module):
    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.timesteps_proj = Timesteps(num_channels=config.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedder = TimestepEmbedding(in_channels=config.freq_dim, time_embed_dim=dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = PixArtAlphaTextProjection(config.text_dim, dim, act_fn="gelu_tanh")
        self.image_embedder = WanImageEmbedding(config.image_dim, dim) if config.image_dim is not None else None

    def forward(self, timestep: torch.Tensor, text: torch.Tensor, image: torch.Tensor | None):
        """`timestep` is (batch,) or (batch, seq) (one per token); temb follows its shape."""
        t_freq = self.timesteps_proj(timestep.flatten()).unflatten(0, timestep.shape)
        temb = self.time_embedder(t_freq.to(self.time_embedder.linear_1.weight.dtype)).type_as(text)
        timestep_proj = self.time_proj(nn.functional.silu(temb)).unflatten(-1, (6, -1))
        image = self.image_embedder(image) if image is not None and self.image_embedder is not None else None
        return temb, timestep_proj, self.text_embedder(text), image


class WanTransformer3DModel(nn.Module):
    """Denoises video latents (batch, C, T, H, W) given a timestep per sample and text (+ image) tokens."""

    _no_split_modules = ["WanTransformerBlock"]
    _repeated_blocks = ["WanTransformerBlock"]
    _keep_in_fp32_modules = ["time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"]
    """Kept fp32 whatever the stage dtype (as diffusers keeps them): the modulation tables, time embedder, norms."""
    _sp_plan: ClassVar[SequencePlan] = {
        "patch_embedding": AtOutput(Split(dim=1)),
        "rope": AtOutput(Split(dim=0)),
        # (temb, timestep_proj, text, image): the first two carry a token axis with per-token timesteps only.
        "condition_embedder": AtOutput((Split(dim=1, ndim=3), Split(dim=1, ndim=4), None, None)),
        "proj_out": AtOutput(Gather(dim=1)),
    }
    """Sequence parallel: each rank holds a slice of the video tokens, of their RoPE rows and per-token timesteps."""

    def __init__(self, config: WanTransformerConfig, prefix: str = "",
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = WanRotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)
        self.patch_embedding = WanPatchEmbedding(config.in_channels, dim, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.condition_embedder = WanConditionEmbedder(config)
        self.blocks = nn.ModuleList(WanTransformerBlock(config, prefix=f"{prefix}blocks.{i}", attn_config=attn_config)
                                    for i in range(config.num_layers))
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    @classmethod
    def from_config(cls, config: dict, *, prefix: str = "",
                    attn_config: DiffusionAttentionConfig | None = None) -> WanTransformer3DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        return cls(WanTransformerConfig.from_dict(config), prefix=prefix, attn_config=attn_config)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None, cache: BlockCache | None = None
                ) -> torch.Tensor:
        """`cache`: this step's view of the request's cache (TeaCache: the blocks run, or the residual they left at
        the last computed step is reused; the probe is the timestep embedding, as TeaCache4Wan2.1 calibrated)."""
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        rotary_emb = self.rope(frames, height, width)
        x = self.patch_embedding(hidden_states)
        temb, timestep_proj, context, image_context = self.condition_embedder(
            timestep, encoder_hidden_states, encoder_hidden_states_image)

        def blocks() -> torch.Tensor:
            out = x
            for block in self.blocks:
                out = block(out, context, image_context, timestep_proj, rotary_emb)
            return out

        x = blocks() if cache is None else cache.run(x, blocks, lambda: temb, len(self.blocks))
        if temb.ndim == 3:  # per-token timesteps
            shift, scale = (s.squeeze(2) for s in (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, 2))
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = self.proj_out((self.norm_out(x.float()) * (1 + scale) + shift).type_as(x))
        x = x.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def cache_dit_block_lists(self) -> dict[str, tuple[nn.ModuleList, int]]:
        """What the cache-dit backend caches: {attribute: (blocks, cache-dit forward pattern)}; Wan's blocks take
        (hidden, context, ...) and return hidden, cache-dit's Pattern_2, as they are."""
        return {"blocks": (self.blocks, 2)}

    def lora_target(self, module: str) -> tuple[str, None]:
        """Our linear computing diffusers module `module` (a LoRA target); Wan fuses no projections."""
        return _rename(module + ".")[:-1], None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors (sharding TP slices); returns the names of the parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for orig_name, tensor in weights:
            name = _rename(orig_name)
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
