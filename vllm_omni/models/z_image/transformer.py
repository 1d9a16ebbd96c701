"""Z-Image's single-stream DiT (diffusers' `ZImageTransformer2DModel`, basic text-to-image mode), our modules.

Image tokens run through `noise_refiner` blocks (timestep-modulated), text tokens through `context_refiner`
blocks (unmodulated), then the joined [image, text] row through the main `layers`. Like diffusers, each stream
is padded to a multiple of 32 tokens with a learned pad token, and the image's RoPE frame position starts after
the row's padded text, so rows with different prompt lengths have different tables. Rows of one forward may
have different text lengths: the image comes first in every row, so a row attends over a prefix of the batch's
sequence (`prefix_attention`) instead of through a mask. Sequence parallel: each rank holds a slice of the
(padded) image tokens and all the text, which sits at the rear of the joined row; the text refiner attends
locally.

Checkpoint names are diffusers'; `load_weights` maps q/k/v onto one `QKVParallelLinear` and the SwiGLU's w1/w3
onto one `MergedColumnParallelLinear`.
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
from vllm_omni.diffusion.distributed.sequence_plan import AtInputs, AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.cuda_graph import device_ints
from vllm_omni.diffusion.layers.embeddings import timestep_sinusoid
from vllm_omni.diffusion.model_loader.weight_utils import load_mapped_weights

SEQ_MULTIPLE = 32
"""Each stream of a row is padded to a multiple of this many tokens (diffusers' `SEQ_MULTI_OF`)."""
ADALN_DIM = 256

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) per channel pair, (batch, seq, head_dim / 2), float32."""


def padded(n: int) -> int:
    return n + (-n) % SEQ_MULTIPLE


def rope_tables(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> Rope:
    """(cos, sin) for integer positions `ids` (..., n_axes): angles in float64 rounded to float32 before cos/sin,
    as diffusers' complex tables are made, so the tables are bit-identical to its lookups."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim))
        angles = (ids[..., axis, None].double() * inv).float()
        cos.append(angles.cos())
        sin.append(angles.sin())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def norm_rope(x: torch.Tensor, norm: nn.RMSNorm, rope: Rope) -> torch.Tensor:
    """Per-head RMSNorm, then rotate adjacent channel pairs in float32 by per-row tables (x: B, S, H, D)."""
    x = norm(x)
    cos, sin = (t[:, :, None] for t in rope)
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


def prefix_attention(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...] | None, image_len: int
) -> torch.Tensor:
    """Row b attends over its first `lengths[b]` tokens (None: all); positions past them come out zero. The
    first `image_len` tokens are image tokens (under sequence parallelism this rank's shard of them), the rest
    text, replicated on every rank (`joint_len` at the rear)."""
    if lengths is None or all(n == q.shape[1] for n in lengths):
        return attn(q, k, v, joint_len=q.shape[1] - image_len)
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths):  # views of the row's real tokens: no gathered copies of q, k, v
        out[b : b + 1, :n] = attn(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], joint_len=n - image_len)
    return out


class ZImageAttention(nn.Module):
    """`local`: attention over replicated tokens only (the text refiner), no sequence-parallel exchange."""

    def __init__(
        self, dim: int, num_heads: int, prefix: str, attn_config: DiffusionAttentionConfig | None, local: bool
    ):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = num_heads // tp
        self.head_dim = dim // num_heads
        # diffusers' Z-Image attention has as many K/V heads as query heads (its `n_kv_heads` is not read).
        self.to_qkv = QKVParallelLinear(
            dim, self.head_dim, num_heads, bias=False, return_bias=False, prefix=f"{prefix}.to_qkv"
        )
        self.norm_q = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.to_out = RowParallelLinear(dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.to_out")
        self.attn = Attention(
            self.num_heads, self.head_dim, prefix=f"{prefix}.attn", attn_config=attn_config, cross_attention=local
        )

    def forward(self, x: torch.Tensor, rope: Rope, lengths: tuple[int, ...] | None, image_len: int) -> torch.Tensor:
        q, k, v = self.to_qkv(x).unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        q, k = norm_rope(q, self.norm_q, rope), norm_rope(k, self.norm_k, rope)
        out = prefix_attention(self.attn, q, k, v, lengths, image_len)
        return self.to_out(out.flatten(2))


class ZImageFeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), w1 and w3 in one GEMM."""

    def __init__(self, dim: int, hidden_dim: int, prefix: str):
        super().__init__()
        self.w13 = MergedColumnParallelLinear(
            dim, [hidden_dim] * 2, bias=False, return_bias=False, prefix=f"{prefix}.w13"
        )
        self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class ZImageTransformerBlock(nn.Module):
    """Sandwich-normed attention and SwiGLU; with `modulation`, tanh-gated and scaled by the timestep. The text
    refiner's blocks (no modulation) see replicated text only and attend locally under sequence parallelism."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        norm_eps: float,
        modulation: bool,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        self.attention = ZImageAttention(dim, num_heads, f"{prefix}.attention", attn_config, local=not modulation)
        self.feed_forward = ZImageFeedForward(dim, int(dim / 3 * 8), f"{prefix}.feed_forward")
        self.attention_norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.attention_norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.adaLN_modulation = nn.Sequential(nn.Linear(min(dim, ADALN_DIM), 4 * dim)) if modulation else None

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(scale_msa, gate_msa, scale_mlp, gate_mlp), each (batch, 1, dim)."""
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(temb)[:, None].chunk(4, dim=-1)
        return 1.0 + scale_msa, gate_msa.tanh(), 1.0 + scale_mlp, gate_mlp.tanh()

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        lengths: tuple[int, ...] | None,
        image_len: int,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x` starts with `image_len` image tokens (this rank's shard); the rest are text tokens."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, lengths, image_len))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.modulation(temb)
        attn = self.attention(self.attention_norm1(x) * scale_msa, rope, lengths, image_len)
        x = x + gate_msa * self.attention_norm2(attn)
        return x + gate_mlp * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * scale_mlp))


class ZImageTokenPadding(nn.Module):
    """Image tokens (B, n, dim) followed by the learned pad token up to `padded(n)`, diffusers' layout."""

    def forward(self, x: torch.Tensor, pad_token: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return torch.cat([x, pad_token.to(x.dtype).expand(b, padded(n) - n, -1)], dim=1)


class ZImageRope(nn.Module):
    """RoPE tables of the padded image tokens and of the text tokens (see `forward`)."""

    def __init__(self, axes_dims: tuple[int, ...], theta: float) -> None:
        super().__init__()
        self.axes_dims, self.theta = tuple(axes_dims), theta

    def forward(
        self, num_rows: int, grid: tuple[int, int], cap_padded: torch.Tensor, cap_len: int, device: torch.device
    ) -> tuple[Rope, Rope]:
        """Image and text tables per row. Text token j sits at frame 1 + j; image tokens at frame (row's padded
        text length + 1) and their (row, column); the image's pad tokens at (0, 0, 0) -- diffusers' ids."""
        h, w = grid
        n = h * w
        img = torch.zeros(num_rows, padded(n), 3, dtype=torch.long, device=device)
        img[:, :n, 0] = cap_padded[:, None] + 1
        img[:, :n, 1] = torch.arange(h, device=device).repeat_interleave(w)
        img[:, :n, 2] = torch.arange(w, device=device).repeat(h)
        cap = torch.zeros(1, cap_len, 3, dtype=torch.long, device=device)
        cap[0, :, 0] = torch.arange(1, cap_len + 1, device=device)
        cap_rope = tuple(t.expand(num_rows, -1, -1) for t in rope_tables(cap, self.axes_dims, self.theta))
        return rope_tables(img, self.axes_dims, self.theta), cap_rope


class ZImageFinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(dim, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_DIM), dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The prediction of the first `num_tokens` tokens of `x` (the image's, without its padding)."""
        x = x[:, :num_tokens]
        scale = 1.0 + self.adaLN_modulation(temb)[:, None]
        return self.linear(F.layer_norm(x, (x.shape[-1],), eps=1e-6) * scale)


class ZImageTransformer2DModel(nn.Module):
    """Same config keys as diffusers' `ZImageTransformer2DModel`; forward takes batched latents (B, C, H, W),
    the timestep in [0, 1] (1 = noise) and zero-padded text features with each row's real length."""

    _repeated_blocks = ("ZImageTransformerBlock",)
    _sp_plan: ClassVar[SequencePlan] = {
        "image_padding": AtOutput(Split(dim=1)),
        "rope": AtOutput((Split(dim=1), None)),  # (padded image tables, text tables): text stays whole
        "all_final_layer.2-1": AtInputs({"x": Gather(dim=1)}),  # gathered before it drops the padding
    }
    """Sequence parallel: each rank holds a slice of the padded image tokens and of their RoPE; text stays
    whole."""

    def __init__(
        self,
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels: int = 16,
        dim: int = 3840,
        n_layers: int = 30,
        n_refiner_layers: int = 2,
        n_heads: int = 30,
        n_kv_heads: int = 30,
        norm_eps: float = 1e-5,
        qk_norm: bool = True,
        cap_feat_dim: int = 2560,
        rope_theta: float = 256.0,
        t_scale: float = 1000.0,
        axes_dims=(32, 48, 48),
        axes_lens=(1024, 512, 512),
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ):
        super().__init__()
        if tuple(all_patch_size) != (2,) or tuple(all_f_patch_size) != (1,) or not qk_norm:
            raise ValueError(
                "only Z-Image's 2x2 image patches with q/k norms are supported, got "
                f"all_patch_size={all_patch_size}, all_f_patch_size={all_f_patch_size}, qk_norm={qk_norm}"
            )
        if dim // n_heads != sum(axes_dims):
            raise ValueError(f"head_dim {dim // n_heads} != sum(axes_dims) {sum(axes_dims)}")
        self.in_channels = in_channels
        self.patch = 2
        self.t_scale = t_scale
        self.rope = ZImageRope(axes_dims, rope_theta)
        self.image_padding = ZImageTokenPadding()
        self.all_x_embedder = nn.ModuleDict({"2-1": nn.Linear(4 * in_channels, dim)})
        self.all_final_layer = nn.ModuleDict({"2-1": ZImageFinalLayer(dim, 4 * in_channels)})

        def blocks(name: str, count: int, modulation: bool) -> nn.ModuleList:
            return nn.ModuleList(
                ZImageTransformerBlock(dim, n_heads, norm_eps, modulation, f"{prefix}{name}.{i}", attn_config)
                for i in range(count)
            )

        self.noise_refiner = blocks("noise_refiner", n_refiner_layers, True)
        self.context_refiner = blocks("context_refiner", n_refiner_layers, False)
        self.layers = blocks("layers", n_layers, True)
        adaln = min(dim, ADALN_DIM)
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(256, 1024), nn.SiLU(), nn.Linear(1024, adaln))
        self.cap_embedder = nn.Sequential(nn.RMSNorm(cap_feat_dim, eps=norm_eps), nn.Linear(cap_feat_dim, dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))

    @classmethod
    def from_config(
        cls, config: dict, *, prefix: str = "", attn_config: DiffusionAttentionConfig | None = None
    ) -> ZImageTransformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        code = cls.__init__.__code__
        keys = set(code.co_varnames[1 : code.co_argcount]) - {"prefix", "attn_config"}
        if config.get("siglip_feat_dim") is not None:
            raise ValueError("Z-Image-Omni checkpoints (siglip_feat_dim set) are not supported by this pipeline")
        return cls(**{k: v for k, v in config.items() if k in keys}, prefix=prefix, attn_config=attn_config)

    def temb(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The adaLN input (batch, 256) for timesteps in [0, 1]."""
        return self.t_embedder.mlp(timestep_sinusoid(timestep * self.t_scale).to(dtype))

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cap_feats: torch.Tensor,
        cap_lengths: tuple[int, ...],
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """`latents` (B, C, H, W), `timestep` (B,) in [0, 1], `cap_feats` (B, L, cap_feat_dim) with row b's
        `cap_lengths[b]` real tokens first. Returns the prediction (B, C, H, W).

        `cache`: this step's view of the request's cache (TeaCache: the refiners and main layers run, or the
        image residual they left at the last computed step is reused; the probe is the first noise-refiner
        block's modulated input)."""
        b, c, hh, ww = latents.shape
        h, w = hh // self.patch, ww // self.patch
        n = h * w
        tokens = latents.view(b, c, h, 2, w, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, n, 4 * c)
        x = self.image_padding(self.all_x_embedder["2-1"](tokens), self.x_pad_token)
        temb = self.temb(timestep, x.dtype)

        cap_padded = [padded(m) for m in cap_lengths]
        cap_len = max(cap_padded)
        cap = self.cap_embedder(F.pad(cap_feats[:, :cap_len], (0, 0, 0, cap_len - min(cap_len, cap_feats.shape[1]))))
        real = torch.arange(cap_len, device=cap.device) < device_ints(cap_lengths, cap.device)[:, None]
        cap = torch.where(real[..., None], cap, self.cap_pad_token.to(cap.dtype))
        img_rope, cap_rope = self.rope(b, (h, w), device_ints(cap_padded, x.device), cap_len, x.device)
        image_len = x.shape[1]
        unified_rope = tuple(torch.cat(pair, dim=1) for pair in zip(img_rope, cap_rope, strict=True))
        cap_lengths_padded = tuple(cap_padded)
        unified_lengths = tuple(image_len + m for m in cap_padded)

        def blocks() -> torch.Tensor:
            img = x
            for block in self.noise_refiner:
                img = block(img, img_rope, None, image_len, temb)
            txt = cap
            for block in self.context_refiner:
                txt = block(txt, cap_rope, cap_lengths_padded, 0)
            joined = torch.cat([img, txt], dim=1)
            for block in self.layers:
                joined = block(joined, unified_rope, unified_lengths, image_len, temb)
            return joined[:, :image_len]

        if cache is None:
            out = blocks()
        else:
            first = self.noise_refiner[0]
            out = cache.run(
                x,
                blocks,
                lambda: first.attention_norm1(x) * first.modulation(temb)[0],
                len(self.noise_refiner) + len(self.context_refiner) + len(self.layers),
            )
        out = self.all_final_layer["2-1"](out, temb, n)
        return out.view(b, h, w, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, hh, ww)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors; returns the names of our parameters that were filled."""
        return load_mapped_weights(self, weights, _map_name)


_STACKED = (
    (".attention.to_q.", ".attention.to_qkv.", "q"),
    (".attention.to_k.", ".attention.to_qkv.", "k"),
    (".attention.to_v.", ".attention.to_qkv.", "v"),
    (".feed_forward.w1.", ".feed_forward.w13.", 0),
    (".feed_forward.w3.", ".feed_forward.w13.", 1),
)


def _map_name(name: str) -> tuple[str, str | int | None]:
    for src, dst, shard in _STACKED:
        if src in name:
            return name.replace(src, dst), shard
    return name.replace(".attention.to_out.0.", ".attention.to_out."), None
