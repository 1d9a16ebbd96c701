"""HunyuanImage-2.1's MMDiT (diffusers' `HunyuanImageTransformer2DModel`, text-to-image), our modules.

The prompt's Qwen2.5-VL features go through a token refiner (self-attention blocks gated by timestep + pooled
prompt), the glyph (ByT5) features through an MLP; a row's text is [its glyph tokens, its prompt tokens]. Then 20
dual-stream and 40 single-stream blocks over [image, text], RoPE on the image tokens only, and an adaLN output
head. diffusers pads every prompt to 1000 + 128 tokens under a key mask; padded text never reaches a real token,
so rows here carry only their real tokens (zero-padded to the longest row of the forward) and each row attends
over its own prefix of [image, text] (`prefix_attention`), which skips the ~1000 padded tokens diffusers runs
through every block. Sequence parallel: each rank holds a slice of the image tokens and all the text, which
sits at the rear of the joined row (`joint_len`); the token refiner sees replicated text only and attends locally.

Checkpoint names are diffusers'; `load_weights` maps to_q/k/v (and the added projections) onto `QKVParallelLinear`s
and, in single blocks, q/k/v and the MLP input onto one `MergedColumnParallelLinear`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.distributed.sequence_plan import AtInputs, AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.cuda_graph import device_ints
from vllm_omni.diffusion.layers.embeddings import MLPEmbedder, timestep_sinusoid
from vllm_omni.diffusion.layers.gelu_linear import linear_gelu_tanh
from vllm_omni.diffusion.layers.modulation import AdaLNModulation, gated_residual, layer_norm_modulate
from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope
from vllm_omni.diffusion.layers.rope import multi_axis_rope_cos_sin
from vllm_omni.diffusion.model_loader.weight_utils import load_mapped_weights

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) per channel pair, (seq, head_dim / 2), float32."""
GLYPH_HIDDEN = 2048
"""Hidden width of diffusers' `HunyuanImageByT5TextProjection`."""


def prefix_attention(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], image_len: int
) -> torch.Tensor:
    """Row b attends over its first `lengths[b]` tokens; positions past them come out zero. The first
    `image_len` tokens are image tokens (under sequence parallelism this rank's shard), the rest the row's text."""
    if all(n == q.shape[1] for n in lengths):
        return attn(q, k, v, joint_len=q.shape[1] - image_len)
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths):  # views of the row's real tokens: no gathered copies of q, k, v
        out[b : b + 1, :n] = attn(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], joint_len=n - image_len)
    return out


class HunyuanImageFeedForward(nn.Module):
    """proj_in -> activation -> proj_out (diffusers `FeedForward`, "gelu-approximate" or "linear-silu")."""

    def __init__(self, dim: int, hidden_dim: int, prefix: str, activation: str = "gelu_tanh"):
        super().__init__()
        self.activation = activation
        self.proj_in = ColumnParallelLinear(dim, hidden_dim, bias=True, return_bias=False, prefix=f"{prefix}.proj_in")
        self.proj_out = RowParallelLinear(hidden_dim, dim, bias=True, return_bias=False, prefix=f"{prefix}.proj_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = linear_gelu_tanh(self.proj_in, x) if self.activation == "gelu_tanh" else F.silu(self.proj_in(x))
        return self.proj_out(hidden)


class HunyuanImageRefinerAttention(nn.Module):
    """Plain self-attention of a token-refiner block (no q/k norm, no RoPE) over each row's real tokens."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads, self.head_dim = num_heads // tp, head_dim
        self.to_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, return_bias=False,
                                        prefix=f"{prefix}.to_qkv")
        self.to_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, return_bias=False,
                                        prefix=f"{prefix}.to_out")
        self.attn = Attention(self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config,
                              cross_attention=True)

    def forward(self, x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        q, k, v = self.to_qkv(x).unflatten(-1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=2)
        return self.to_out(prefix_attention(self.attn, q, k, v, lengths, 0).flatten(2))


class HunyuanImageRefinerBlock(nn.Module):
    """Token-refiner block: LayerNorm -> self-attention -> gated residual, LayerNorm -> SiLU MLP -> gated
    residual, the gates from the timestep + pooled-prompt conditioning."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = HunyuanImageRefinerAttention(dim, num_heads, head_dim, f"{prefix}.attn", attn_config)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ff = HunyuanImageFeedForward(dim, 4 * dim, f"{prefix}.ff", activation="silu")
        self.norm_out = AdaLNModulation(dim, 2)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        gate_msa, gate_mlp = self.norm_out(temb).chunk(2, dim=-1)
        x = gated_residual(x, gate_msa, self.attn(self.norm1(x), lengths))
        return gated_residual(x, gate_mlp, self.ff(self.norm2(x)))


class HunyuanImageTokenRefiner(nn.Module):
    """diffusers' `HunyuanImageTokenRefiner` (`context_embedder`): the prompt features, refined under a
    timestep + masked-mean-pooled-prompt conditioning."""

    def __init__(self, in_dim: int, dim: int, num_heads: int, head_dim: int, num_layers: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = MLPEmbedder(256, dim)
        self.time_text_embed.text_embedder = MLPEmbedder(in_dim, dim)
        self.proj_in = nn.Linear(in_dim, dim)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(
            HunyuanImageRefinerBlock(dim, num_heads, head_dim, f"{prefix}.token_refiner.refiner_blocks.{i}",
                                     attn_config)
            for i in range(num_layers)
        )

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """`x` (B, L, in_dim) with row b's `lengths[b]` real tokens first (zeros after)."""
        real = (torch.arange(x.shape[1], device=x.device) < device_ints(lengths, x.device)[:, None])[..., None]
        pooled = (x.float() * real).sum(dim=1) / real.sum(dim=1)
        embed = self.time_text_embed
        temb = embed.timestep_embedder(timestep_sinusoid(timestep).to(x.dtype))
        temb = temb + embed.text_embedder(pooled.to(x.dtype))
        x = self.proj_in(x)
        for block in self.token_refiner.refiner_blocks:
            x = block(x, temb, lengths)
        return x


class HunyuanImageGlyphProjection(nn.Module):
    """diffusers' `HunyuanImageByT5TextProjection` (`context_embedder_2`): LayerNorm and a 3-layer GELU MLP."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, GLYPH_HIDDEN)
        self.linear_2 = nn.Linear(GLYPH_HIDDEN, GLYPH_HIDDEN)
        self.linear_3 = nn.Linear(GLYPH_HIDDEN, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_3(F.gelu(self.linear_2(F.gelu(self.linear_1(self.norm(x))))))


class HunyuanImageJointAttention(nn.Module):
    """Joint [image, text] attention of a dual-stream block (each stream has its own projections and q/k norms;
    RoPE on the image only)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads, self.head_dim = num_heads // tp, head_dim
        self.to_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, return_bias=False,
                                        prefix=f"{prefix}.to_qkv")
        self.add_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, return_bias=False,
                                         prefix=f"{prefix}.add_qkv")
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.to_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, return_bias=False,
                                        prefix=f"{prefix}.to_out")
        self.to_add_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, return_bias=False,
                                            prefix=f"{prefix}.to_add_out")
        self.attn = Attention(self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, img_rope: Rope, txt_rope: Rope,
                lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = qk_norm_rope(
            self.to_qkv(x), (self.norm_q.weight, self.norm_k.weight), img_rope, txt_qkv=self.add_qkv(ctx),
            txt_norms=(self.norm_added_q.weight, self.norm_added_k.weight), txt_rope=txt_rope,
            num_heads=self.num_heads, eps=self.norm_q.eps, text_first=False,
        )
        out = prefix_attention(self.attn, q, k, v, lengths, x.shape[1]).flatten(2)
        x_out, ctx_out = out.split([x.shape[1], ctx.shape[1]], dim=1)
        return self.to_out(x_out.contiguous()), self.to_add_out(ctx_out.contiguous())


class HunyuanImageTransformerBlock(nn.Module):
    """Dual-stream block: adaLN-Zero and an MLP per stream, one joint attention."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        self.norm1 = AdaLNModulation(dim, 6)
        self.norm1_context = AdaLNModulation(dim, 6)
        self.attn = HunyuanImageJointAttention(dim, num_heads, head_dim, f"{prefix}.attn", attn_config)
        self.ff = HunyuanImageFeedForward(dim, int(dim * mlp_ratio), f"{prefix}.ff")
        self.ff_context = HunyuanImageFeedForward(dim, int(dim * mlp_ratio), f"{prefix}.ff_context")

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, temb: torch.Tensor, img_rope: Rope, txt_rope: Rope,
                lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb).chunk(6, dim=-1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = \
            self.norm1_context(temb).chunk(6, dim=-1)
        attn_x, attn_ctx = self.attn(layer_norm_modulate(x, shift_msa, scale_msa),
                                     layer_norm_modulate(ctx, c_shift_msa, c_scale_msa), img_rope, txt_rope, lengths)
        x = gated_residual(x, gate_msa, attn_x)
        ctx = gated_residual(ctx, c_gate_msa, attn_ctx)
        x = gated_residual(x, gate_mlp, self.ff(layer_norm_modulate(x, shift_mlp, scale_mlp)))
        ctx = gated_residual(ctx, c_gate_mlp, self.ff_context(layer_norm_modulate(ctx, c_shift_mlp, c_scale_mlp)))
        return x, ctx


class HunyuanImageSingleAttention(nn.Module):
    """The per-head q/k norms and the attention op of a single-stream block (names as in diffusers)."""

    def __init__(self, num_heads: int, head_dim: int, prefix: str, attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.attn = Attention(num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)


class HunyuanImageSingleTransformerBlock(nn.Module):
    """Single-stream block on the joined [image, text] row: attention and MLP off one modulated input."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, prefix: str,
                 attn_config: DiffusionAttentionConfig | None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.mlp_dim = int(dim * mlp_ratio)
        inner = num_heads * head_dim
        self.local_heads = num_heads // tp
        self.norm = AdaLNModulation(dim, 3)
        self.to_qkv_mlp = MergedColumnParallelLinear(dim, [inner, inner, inner, self.mlp_dim], bias=True,
                                                     return_bias=False, prefix=f"{prefix}.to_qkv_mlp")
        self.attn = HunyuanImageSingleAttention(self.local_heads, head_dim, f"{prefix}.attn", attn_config)
        self.proj_out = RowParallelLinear(inner + self.mlp_dim, dim, bias=True, return_bias=False,
                                          prefix=f"{prefix}.proj_out")

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: Rope, lengths: tuple[int, ...],
                image_len: int) -> torch.Tensor:
        shift, scale, gate = self.norm(temb).chunk(3, dim=-1)
        qkv_mlp = self.to_qkv_mlp(layer_norm_modulate(x, shift, scale))
        q, k, v = qk_norm_rope(qkv_mlp, (self.attn.norm_q.weight, self.attn.norm_k.weight), rope,
                               num_heads=self.local_heads, eps=self.attn.norm_q.eps)
        mlp = qkv_mlp[..., 3 * self.local_heads * self.head_dim:]
        out = prefix_attention(self.attn.attn, q, k, v, lengths, image_len).flatten(2)
        return gated_residual(x, gate, self.proj_out(torch.cat([out, F.gelu(mlp, approximate="tanh")], dim=-1)))


class HunyuanImagePatchEmbed(nn.Module):
    """Latents (B, C, H, W) -> patch tokens (B, patches, dim), row-major over the patch grid."""

    def __init__(self, in_channels: int, dim: int, patch_size: tuple[int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.proj(latents).flatten(2).transpose(1, 2)


class HunyuanImageRope(nn.Module):
    """RoPE tables of the (h, w) patch grid: token (i, j) at position (i, j) on the two axes."""

    def __init__(self, axes_dim: tuple[int, ...], theta: float) -> None:
        super().__init__()
        self.axes_dim, self.theta = tuple(axes_dim), theta

    def forward(self, h: int, w: int, device: torch.device) -> Rope:
        ids = torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                         indexing="ij"), dim=-1).view(h * w, 2)
        return multi_axis_rope_cos_sin(ids, self.axes_dim, self.theta)


class HunyuanImageTransformer2DModel(nn.Module):
    """Same config keys as diffusers' `HunyuanImageTransformer2DModel` (2D patches); forward takes batched
    latents (B, C, H, W), raw timesteps (0..1000) and each row's real prompt / glyph tokens, zero-padded."""

    _repeated_blocks = ("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock")
    _sp_plan: ClassVar[SequencePlan] = {
        "x_embedder": AtOutput(Split(dim=1)),
        "rope": AtOutput(Split(dim=0)),
        "proj_out": AtInputs({"input": Gather(dim=1)}),  # the final norm is per token: gathered after it
    }
    """Sequence parallel: each rank holds a slice of the image tokens and of their RoPE rows; text stays whole."""

    def __init__(
        self,
        in_channels: int = 64,
        out_channels: int = 64,
        num_attention_heads: int = 28,
        attention_head_dim: int = 128,
        num_layers: int = 20,
        num_single_layers: int = 40,
        num_refiner_layers: int = 2,
        mlp_ratio: float = 4.0,
        patch_size=(1, 1),
        qk_norm: str = "rms_norm",
        guidance_embeds: bool = False,
        text_embed_dim: int = 3584,
        text_embed_2_dim: int | None = None,
        rope_theta: float = 256.0,
        rope_axes_dim=(64, 64),
        use_meanflow: bool = False,
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ):
        super().__init__()
        if len(patch_size) != 2 or qk_norm != "rms_norm":
            raise ValueError(f"only 2D patches with rms_norm q/k norms are supported, got patch_size={patch_size}, "
                             f"qk_norm={qk_norm!r}")
        if sum(rope_axes_dim) != attention_head_dim:
            raise ValueError(f"sum(rope_axes_dim) {sum(rope_axes_dim)} != attention_head_dim {attention_head_dim}")
        dim = num_attention_heads * attention_head_dim
        self.in_channels, self.out_channels = in_channels, out_channels or in_channels
        self.patch_size = tuple(patch_size)
        self.guidance_embeds, self.use_meanflow = guidance_embeds, use_meanflow
        self.x_embedder = HunyuanImagePatchEmbed(in_channels, dim, self.patch_size)
        self.rope = HunyuanImageRope(rope_axes_dim, rope_theta)
        self.context_embedder = HunyuanImageTokenRefiner(
            text_embed_dim, dim, num_attention_heads, attention_head_dim, num_refiner_layers,
            f"{prefix}context_embedder", attn_config,
        )
        self.context_embedder_2 = (HunyuanImageGlyphProjection(text_embed_2_dim, dim)
                                   if text_embed_2_dim is not None else None)
        self.time_guidance_embed = nn.Module()
        self.time_guidance_embed.timestep_embedder = MLPEmbedder(256, dim)
        if use_meanflow:
            self.time_guidance_embed.timestep_embedder_r = MLPEmbedder(256, dim)
        if guidance_embeds:
            self.time_guidance_embed.guidance_embedder = MLPEmbedder(256, dim)
        self.transformer_blocks = nn.ModuleList(
            HunyuanImageTransformerBlock(dim, num_attention_heads, attention_head_dim, mlp_ratio,
                                         f"{prefix}transformer_blocks.{i}", attn_config)
            for i in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            HunyuanImageSingleTransformerBlock(dim, num_attention_heads, attention_head_dim, mlp_ratio,
                                               f"{prefix}single_transformer_blocks.{i}", attn_config)
            for i in range(num_single_layers)
        )
        self.norm_out = AdaLNModulation(dim, 2)
        self.proj_out = nn.Linear(dim, math.prod(self.patch_size) * self.out_channels)

    @classmethod
    def from_config(cls, config: dict, *, prefix: str = "", attn_config: DiffusionAttentionConfig | None = None
                    ) -> HunyuanImageTransformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        code = cls.__init__.__code__
        keys = set(code.co_varnames[1 : code.co_argcount]) - {"prefix", "attn_config"}
        return cls(**{k: v for k, v in config.items() if k in keys}, prefix=prefix, attn_config=attn_config)

    def temb(self, timestep: torch.Tensor, timestep_r: torch.Tensor | None, guidance: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
        """The blocks' conditioning (B, dim): timestep (averaged with the next one for MeanFlow) + guidance."""
        embed = self.time_guidance_embed
        temb = embed.timestep_embedder(timestep_sinusoid(timestep).to(dtype))
        if self.use_meanflow:
            if timestep_r is None:
                raise ValueError("this HunyuanImage transformer is MeanFlow-distilled: `timestep_r` is required")
            temb = (temb + embed.timestep_embedder_r(timestep_sinusoid(timestep_r).to(dtype))) / 2
        if self.guidance_embeds:
            if guidance is None:
                raise ValueError("this HunyuanImage transformer is guidance-distilled: `guidance` is required")
            temb = temb + embed.guidance_embedder(timestep_sinusoid(guidance).to(dtype))
        return temb

    def text(self, embeds: torch.Tensor, lengths: tuple[int, ...], glyph: torch.Tensor | None,
             glyph_lengths: tuple[int, ...] | None, timestep: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Each row's text tokens [glyph, refined prompt], zero-padded to the longest row, and their counts."""
        ctx = self.context_embedder(embeds, timestep, lengths)
        if self.context_embedder_2 is None or glyph is None or not any(glyph_lengths):
            return ctx, lengths
        glyph = self.context_embedder_2(glyph)
        counts = tuple(m + n for m, n in zip(glyph_lengths, lengths, strict=True))
        out = ctx.new_zeros(ctx.shape[0], max(counts), ctx.shape[2])
        for b, (m, n) in enumerate(zip(glyph_lengths, lengths, strict=True)):
            out[b, :m] = glyph[b, :m]
            out[b, m : m + n] = ctx[b, :n]
        return out, counts

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        lengths: tuple[int, ...],
        glyph: torch.Tensor | None = None,
        glyph_lengths: tuple[int, ...] | None = None,
        timestep_r: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """`latents` (B, C, H, W); `timestep` (B,) raw (0..1000, in the model's dtype as diffusers casts it);
        `embeds` (B, L, text_embed_dim) with row b's `lengths[b]` real prompt tokens first, `glyph`
        (B, L2, text_embed_2_dim) likewise with `glyph_lengths` (0: no quoted text); `timestep_r` the next
        timestep (MeanFlow), `guidance` the distilled guidance x 1000. Returns the prediction (B, C, H, W).

        `cache`: this step's view of the request's cache (TeaCache: the dual and single blocks run, or the image
        residual they left at the last computed step is reused; the probe is block 0's modulated image input)."""
        b, _, hh, ww = latents.shape
        ph, pw = self.patch_size
        h, w = hh // ph, ww // pw
        x = self.x_embedder(latents)
        temb = self.temb(timestep, timestep_r, guidance, x.dtype)
        ctx, text_lengths = self.text(embeds, lengths, glyph, glyph_lengths, timestep)
        img_rope = self.rope(h, w, x.device)
        txt_rope = (img_rope[0].new_ones(ctx.shape[1], img_rope[0].shape[1]),
                    img_rope[1].new_zeros(ctx.shape[1], img_rope[1].shape[1]))
        image_len = x.shape[1]
        joint_rope = tuple(torch.cat(pair) for pair in zip(img_rope, txt_rope, strict=True))
        joint_lengths = tuple(image_len + n for n in text_lengths)

        def blocks() -> torch.Tensor:
            img, txt = x, ctx
            for block in self.transformer_blocks:
                img, txt = block(img, txt, temb, img_rope, txt_rope, joint_lengths)
            joined = torch.cat([img, txt], dim=1)
            for block in self.single_transformer_blocks:
                joined = block(joined, temb, joint_rope, joint_lengths, image_len)
            return joined[:, :image_len]

        if cache is None:
            out = blocks()
        else:
            first = self.transformer_blocks[0]
            out = cache.run(x, blocks, lambda: layer_norm_modulate(x, *first.norm1(temb).chunk(6, dim=-1)[:2]),
                            len(self.transformer_blocks) + len(self.single_transformer_blocks))
        scale, shift = self.norm_out(temb).chunk(2, dim=-1)
        out = self.proj_out(layer_norm_modulate(out, shift, scale))
        out = out.view(b, h, w, self.out_channels, ph, pw).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, self.out_channels, hh, ww)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors; returns the names of our parameters that were filled."""
        return load_mapped_weights(self, (self._interleaved(name, t) for name, t in weights), _map_name)

    def _interleaved(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A single block's proj_out takes [attn | mlp] columns; under TP each rank's contiguous slice must be its
        own heads then its MLP share, so the columns are reordered [attn_0 | mlp_0 | attn_1 | mlp_1 ...]."""
        tp = get_tensor_model_parallel_world_size()
        if tp == 1 or not (name.startswith("single_transformer_blocks.") and name.endswith(".proj_out.weight")):
            return name, tensor
        mlp_dim = self.single_transformer_blocks[0].mlp_dim
        attn = tensor[:, : tensor.shape[1] - mlp_dim].chunk(tp, dim=1)
        mlp = tensor[:, tensor.shape[1] - mlp_dim :].chunk(tp, dim=1)
        return name, torch.cat([p for pair in zip(attn, mlp, strict=True) for p in pair], dim=1)


# (diffusers sub-name, our sub-name, shard id) for tensors that land in a fused parameter.
_REFINER_STACKED = (
    (".attn.to_q.", ".attn.to_qkv.", "q"),
    (".attn.to_k.", ".attn.to_qkv.", "k"),
    (".attn.to_v.", ".attn.to_qkv.", "v"),
)
_DOUBLE_STACKED = (
    *_REFINER_STACKED,
    (".attn.add_q_proj.", ".attn.add_qkv.", "q"),
    (".attn.add_k_proj.", ".attn.add_qkv.", "k"),
    (".attn.add_v_proj.", ".attn.add_qkv.", "v"),
)
_SINGLE_STACKED = (
    (".attn.to_q.", ".to_qkv_mlp.", 0),
    (".attn.to_k.", ".to_qkv_mlp.", 1),
    (".attn.to_v.", ".to_qkv_mlp.", 2),
    (".proj_mlp.", ".to_qkv_mlp.", 3),
)
_RENAMES = (
    (".attn.to_out.0.", ".attn.to_out."),
    (".ff.net.0.proj.", ".ff.proj_in."),
    (".ff.net.2.", ".ff.proj_out."),
    (".ff_context.net.0.proj.", ".ff_context.proj_in."),
    (".ff_context.net.2.", ".ff_context.proj_out."),
)


def _map_name(name: str) -> tuple[str, str | int | None]:
    if name.startswith("single_transformer_blocks."):
        stacked = _SINGLE_STACKED
    elif name.startswith("transformer_blocks."):
        stacked = _DOUBLE_STACKED
    elif name.startswith("context_embedder.token_refiner."):
        stacked = _REFINER_STACKED
    else:
        stacked = ()
    shard = None
    for src, dst, sid in stacked:
        if src in name:
            name, shard = name.replace(src, dst), sid
            break
    for src, dst in _RENAMES:
        name = name.replace(src, dst)
    return name, shard
