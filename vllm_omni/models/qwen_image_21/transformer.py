"""Qwen-Image-2.1's single-stream DiT (diffusers' `QwenImage21Transformer2DModel`, text-to-image), our modules.

The joint sequence is [text, target image] under a block-causal mask: text tokens attend causally to text only,
image tokens to everything. Text tokens are modulated from t = 0 (`causal_condition`), so their activations, and
the K/V they contribute at every layer, do not depend on the step: `prefix_kv` computes them once per request
(the pipeline keeps them in the request's conditioning) and every step's `forward` runs only the image tokens,
attending over [the row's prefix K/V, its own K/V]. That is diffusers' "extract" step and "cached" steps at once:
its extract step computes the same text rows (they never see the image) and the same image rows.

Rows of one forward may carry prefixes of different lengths (co-batched requests): the prefix K/V arrive
zero-padded and each row attends over its own first `prefix_lengths[b]` prefix tokens (`prefix_attention`).
Sequence parallel is not implemented (the prefix is replicated and the image queries attend over keys of another
length); tensor parallel shards heads and the SwiGLU as vLLM's linears do.

Checkpoint names are diffusers'; `load_weights` maps to_q/k/v onto one `QKVParallelLinear` and the SwiGLU's
gate_layer/proj onto one `MergedColumnParallelLinear`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.layers.embeddings import timestep_sinusoid
from vllm_omni.diffusion.model_loader.weight_utils import load_mapped_weights

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) per channel pair, (rows, seq, head_dim / 2), float32."""


def rope_tables(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> Rope:
    """(cos, sin) for signed integer positions `ids` (rows, seq, 3): float32 angles as diffusers' polar tables."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device).div(dim))
        angles = ids[..., axis, None].float() * inv
        cos.append(angles.cos())
        sin.append(angles.sin())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def text_positions(n: int, device: torch.device) -> torch.Tensor:
    """Text token j sits at j on all three axes."""
    return torch.arange(n, device=device)[:, None].expand(n, 3)


def image_positions(prefix_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """The target image after `prefix_len` text tokens: frame at `prefix_len`, a (row, column) grid centred on 0."""
    ids = torch.empty(h, w, 3, dtype=torch.long, device=device)
    ids[..., 0] = prefix_len
    ids[..., 1] = torch.arange(-(h - h // 2), h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(-(w - w // 2), w // 2, device=device)[None, :]
    return ids.view(h * w, 3)


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate adjacent channel pairs in float32 (x: B, S, H, D), as diffusers' complex product does."""
    cos, sin = (t[:, :, None] for t in rope)
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


def prefix_attention(
    attn: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_lengths: tuple[int, ...],
) -> torch.Tensor:
    """Row b's queries attend over [its first `prefix_lengths[b]` prefix K/V, its own K/V]. Rows of one length: one
    attention over the batch. Otherwise (CFG's negative prompt, co-batched requests) one key and one value buffer
    hold each row's prefix right-aligned before its own tokens, so every row attends over a view of them: one
    copy of the step's K/V in all, where gathering the rows of each length copied q, k and v twice more."""
    longest = max(prefix_lengths)
    if min(prefix_lengths) == longest:
        return attn(q, torch.cat([prefix_k[:, :longest], k], dim=1), torch.cat([prefix_v[:, :longest], v], dim=1))
    keys = k.new_empty(k.shape[0], longest + k.shape[1], *k.shape[2:])
    values = torch.empty_like(keys)
    keys[:, longest:], values[:, longest:] = k, v
    out = torch.empty_like(q)
    for b, n in enumerate(prefix_lengths):
        start = longest - n
        keys[b, start:longest], values[b, start:longest] = prefix_k[b, :n], prefix_v[b, :n]
        out[b : b + 1] = attn(q[b : b + 1], keys[b : b + 1, start:], values[b : b + 1, start:])
    return out


class QwenImage21Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        eps: float,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = num_heads // tp
        self.head_dim = head_dim
        self.to_qkv = QKVParallelLinear(
            dim, head_dim, num_heads, bias=False, return_bias=False, prefix=f"{prefix}.to_qkv"
        )
        self.to_out = RowParallelLinear(
            num_heads * head_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.to_out"
        )
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        # The text rows of the prefix pass attend causally over the text; the image rows over everything.
        self.causal_attn = Attention(
            self.num_heads,
            head_dim,
            causal=True,
            prefix=f"{prefix}.causal_attn",
            attn_config=attn_config,
            cross_attention=True,
        )
        self.attn = Attention(
            self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config, cross_attention=True
        )

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.to_qkv(x).unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        return rotate(self.norm_q(q), rope), rotate(self.norm_k(k), rope), v


class QwenImage21FeedForward(nn.Module):
    """SwiGLU: out(silu(gate_layer x) * proj x), gate_layer and proj in one GEMM."""

    def __init__(self, dim: int, hidden_dim: int, prefix: str):
        super().__init__()
        self.gate_proj = MergedColumnParallelLinear(
            dim, [hidden_dim] * 2, bias=False, return_bias=False, prefix=f"{prefix}.gate_proj"
        )
        self.out = RowParallelLinear(hidden_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


class QwenImage21TransformerBlock(nn.Module):
    """Scale-only modulated attention and SwiGLU with tanh gates; the modulation is the model's, shared by every
    block. `prefix_kv` runs the text rows, `forward` the image rows against the text's K/V."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_ratio: int,
        eps: float,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        self.eps = eps
        self.attn = QwenImage21Attention(dim, num_heads, head_dim, eps, f"{prefix}.attn", attn_config)
        self.img_mlp = QwenImage21FeedForward(dim, dim * mlp_ratio, f"{prefix}.img_mlp")

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def mlp(self, x: torch.Tensor, mod: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return x + mod[3] * self.img_mlp(self.norm(x) * mod[2])

    def prefix_kv(
        self, x: torch.Tensor, rope: Rope, mod: tuple[torch.Tensor, ...], blocks: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefix rows through this block, and their K/V (post-RoPE). Text rows: causal attention (a text
        row sees every key up to its own); the rows of each image block `(start, end)`: every key before `end`."""
        q, k, v = self.attn.qkv(self.norm(x) * mod[0], rope)
        out = self.attn.causal_attn(q, k, v)
        for start, end in blocks:
            out[:, start:end] = self.attn.attn(q[:, start:end], k[:, :end], v[:, :end])
        x = x + mod[1] * self.attn.to_out(out.flatten(2))
        return self.mlp(x, mod), k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        mod: tuple[torch.Tensor, ...],
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        prefix_lengths: tuple[int, ...],
    ) -> torch.Tensor:
        q, k, v = self.attn.qkv(self.norm(x) * mod[0], rope)
        out = prefix_attention(self.attn.attn, q, k, v, prefix_k, prefix_v, prefix_lengths)
        x = x + mod[1] * self.attn.to_out(out.flatten(2))
        return self.mlp(x, mod)


class QwenImage21Transformer2DModel(nn.Module):
    """Same config keys as diffusers' `QwenImage21Transformer2DModel`. `prefix_kv(text, ...)` -> one prefix's K/V at
    every layer; `forward(latents, timestep, prefix_kv, prefix_lengths, frames, grid)` -> the target's prediction."""

    _repeated_blocks = ("QwenImage21TransformerBlock",)
    _sp_plan: ClassVar[None] = None
    """No sequence parallelism (`distributed/sequence_plan.py` refuses it at build): its image rows attend over a
    per-request text prefix of another length."""

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = 64,
        num_layers: int = 32,
        attention_head_dim: int = 128,
        num_attention_heads: int = 32,
        context_in_dim: int = 4096,
        mlp_ratio: int = 3,
        axes_dims_rope=(16, 56, 56),
        eps: float = 1e-6,
        causal_condition: bool = True,
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ):
        super().__init__()
        if patch_size != 1 or not causal_condition:
            raise ValueError(
                "only Qwen-Image-2.1's unpatched latents with causal_condition=True are supported, got "
                f"patch_size={patch_size}, causal_condition={causal_condition}"
            )
        if sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(f"sum(axes_dims_rope) {sum(axes_dims_rope)} != attention_head_dim {attention_head_dim}")
        dim = num_attention_heads * attention_head_dim
        self.in_channels = in_channels
        self.num_heads = num_attention_heads // get_tensor_model_parallel_world_size()
        self.head_dim = attention_head_dim
        self.axes_dims = tuple(axes_dims_rope)
        self.eps = eps
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = nn.Module()
        self.time_text_embed.timestep_embedder.linear_1 = nn.Linear(256, dim, bias=False)
        self.time_text_embed.timestep_embedder.linear_2 = nn.Linear(dim, dim, bias=False)
        self.txt_in = nn.Module()
        self.txt_in.text_norm = nn.Module()
        self.txt_in.text_norm.weight = nn.Parameter(torch.zeros(context_in_dim))
        self.txt_in.in_layer = nn.Linear(context_in_dim, dim, bias=False)
        self.txt_in.out_layer = nn.Linear(dim, dim, bias=False)
        self.img_in = nn.Linear(in_channels, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            QwenImage21TransformerBlock(
                dim,
                num_attention_heads,
                attention_head_dim,
                mlp_ratio,
                eps,
                f"{prefix}transformer_blocks.{i}",
                attn_config,
            )
            for i in range(num_layers)
        )
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(dim, dim, bias=False)
        self.proj_out = nn.Linear(dim, out_channels or in_channels, bias=False)

    @classmethod
    def from_config(
        cls, config: dict, *, prefix: str = "", attn_config: DiffusionAttentionConfig | None = None
    ) -> QwenImage21Transformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        code = cls.__init__.__code__
        keys = set(code.co_varnames[1 : code.co_argcount]) - {"prefix", "attn_config"}
        return cls(**{k: v for k, v in config.items() if k in keys}, prefix=prefix, attn_config=attn_config)

    def temb(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(rows, dim) for timesteps in [0, 1] (1 = noise)."""
        embedder = self.time_text_embed.timestep_embedder
        return embedder.linear_2(F.silu(embedder.linear_1(timestep_sinusoid(timestep * 1000.0).to(dtype))))

    def block_modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(1 + attention scale, attention gate, 1 + MLP scale, MLP gate), each (rows, 1, dim), every block's."""
        scale1, gate1, scale2, gate2 = self.modulation(temb)[:, None].chunk(4, dim=-1)
        return 1 + scale1, gate1.tanh(), 1 + scale2, gate2.tanh()

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """txt_in: zero-centred RMSNorm (scale `weight + 1`, float32), Linear, tanh-GELU, Linear."""
        x = text.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.txt_in.text_norm.weight.float() + 1)
        x = self.txt_in.in_layer(x.to(text.dtype))
        return self.txt_in.out_layer(F.gelu(x, approximate="tanh"))

    def prefix_kv(
        self,
        text: torch.Tensor,
        image_slots: torch.Tensor | None = None,
        images: list[tuple[torch.Tensor, int, int]] = (),
    ) -> tuple[torch.Tensor, int]:
        """K/V at every layer of one prefix, (1, layers, 2, tokens, heads, head_dim), and the frame position the
        target image takes after it. `text` (1, n, context_in_dim): the text encoder's states; `image_slots` (n,)
        bool marks the slots of the condition `images` ((1, h * w, in_channels) latents, h, w), in order: each
        slot stands for 2 x 2 latent tokens. The prefix attends only to itself and is modulated from t = 0, so
        this holds for every step."""
        x = self.embed_text(text)
        pieces, ids, blocks = [], [], []
        frame, cursor, length = 0, 0, 0
        slot_index = [] if image_slots is None else image_slots.nonzero().flatten().tolist()
        for latents, h, w in images:
            start = slot_index[0]
            del slot_index[: h * w // 4]
            pieces += [x[:, cursor:start], self.img_in(latents)]
            ids += [
                text_positions(start - cursor, x.device) + frame,
                image_positions(frame + start - cursor, h, w, x.device),
            ]
            frame += start - cursor
            blocks.append((length + start - cursor, length + start - cursor + h * w))
            length += start - cursor + h * w
            frame += max(h, w)
            cursor = start + h * w // 4
        n = text.shape[1] - cursor
        pieces.append(x[:, cursor:])
        ids.append(text_positions(n, x.device) + frame)
        x = torch.cat(pieces, dim=1)
        rope = rope_tables(torch.cat(ids)[None], self.axes_dims, 10000.0)
        mod = self.block_modulation(self.temb(x.new_zeros(1), x.dtype))
        kv = x.new_empty(1, len(self.transformer_blocks), 2, x.shape[1], self.num_heads, self.head_dim)
        for i, block in enumerate(self.transformer_blocks):
            x, kv[:, i, 0], kv[:, i, 1] = block.prefix_kv(x, rope, mod, blocks)
        return kv, frame + n

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        prefix_kv: torch.Tensor,
        prefix_lengths: tuple[int, ...],
        frames: tuple[int, ...],
        grid: tuple[int, int],
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """`latents` (rows, h * w, in_channels) of the `grid` (h, w), `timestep` (rows,) in [0, 1], `prefix_kv`
        (rows, layers, 2, >= max(prefix_lengths), heads, head_dim) with row b's first `prefix_lengths[b]` real,
        `frames` the target's frame position after each row's prefix (`prefix_kv`'s second result).

        `cache`: this step's view of the request's cache (TeaCache: the blocks run, or the residual they left at
        the last computed step is reused; the probe is the first block's modulated input)."""
        h, w = grid
        x = self.img_in(latents)
        temb = self.temb(timestep, x.dtype)
        mod = self.block_modulation(temb)
        ids = torch.stack([image_positions(frame, h, w, x.device) for frame in frames])
        rope = rope_tables(ids, self.axes_dims, 10000.0)
        first = self.transformer_blocks[0]

        def blocks() -> torch.Tensor:
            out = x
            for i, block in enumerate(self.transformer_blocks):
                out = block(out, rope, mod, prefix_kv[:, i, 0], prefix_kv[:, i, 1], prefix_lengths)
            return out

        if cache is None:
            out = blocks()
        else:
            out = cache.run(x, blocks, lambda: first.norm(x) * mod[0], len(self.transformer_blocks))
        scale = 1 + self.norm_out.linear(F.silu(temb).to(out.dtype))[:, None]
        return self.proj_out(F.layer_norm(out, (out.shape[-1],), eps=self.eps) * scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors; returns the names of our parameters that were filled."""
        return load_mapped_weights(self, weights, _map_name)


_STACKED = (
    (".attn.to_q.", ".attn.to_qkv.", "q"),
    (".attn.to_k.", ".attn.to_qkv.", "k"),
    (".attn.to_v.", ".attn.to_qkv.", "v"),
    (".img_mlp.gate_layer.", ".img_mlp.gate_proj.", 0),
    (".img_mlp.proj.", ".img_mlp.gate_proj.", 1),
)


def _map_name(name: str) -> tuple[str, str | int | None]:
    for src, dst, shard in _STACKED:
        if src in name:
            return name.replace(src, dst), shard
    return name.replace(".attn.to_out.0.", ".attn.to_out."), None
