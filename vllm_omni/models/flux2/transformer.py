"""FLUX.2 MMDiT (diffusers' `Flux2Transformer2DModel`): double-stream then single-stream blocks, our modules.

Unlike FLUX.1, every block of a kind shares one adaLN modulation computed once per forward from the timestep
(and distilled guidance), no linear has a bias, the MLPs are SwiGLU and RoPE has four axes (t, h, w, l).
Checkpoint names are diffusers'; `load_weights` maps q/k/v onto one `QKVParallelLinear`, the packed SwiGLU input
onto a `MergedColumnParallelLinear` and, in single blocks, the packed q/k/v + MLP input onto another.
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
from vllm_omni.diffusion.distributed.sequence_plan import AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.embeddings import timestep_sinusoid
from vllm_omni.diffusion.layers.modulation import AdaLNModulation, gated_residual, layer_norm_modulate
from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope
from vllm_omni.diffusion.layers.rope import JointRope
from vllm_omni.diffusion.model_loader.weight_utils import default_weight_loader

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) per channel pair, (text + image tokens, head_dim / 2), float32."""


class Flux2TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2 without biases (diffusers `TimestepEmbedding(sample_proj_bias=False)`)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Flux2TimeGuidanceEmbedding(nn.Module):
    def __init__(self, channels: int, dim: int, guidance_embeds: bool):
        super().__init__()
        self.channels = channels
        self.timestep_embedder = Flux2TimestepEmbedding(channels, dim)
        self.guidance_embedder = Flux2TimestepEmbedding(channels, dim) if guidance_embeds else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(timestep, self.channels).to(timestep.dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError("this FLUX.2 transformer is guidance-distilled: `guidance` is required")
            emb = emb + self.guidance_embedder(timestep_sinusoid(guidance, self.channels).to(guidance.dtype))
        return emb


class Flux2FeedForward(nn.Module):
    """SwiGLU: linear_out(silu(gate) * up), gate and up packed in `linear_in` as in the checkpoint."""

    def __init__(self, dim: int, hidden_dim: int, prefix: str):
        super().__init__()
        self.linear_in = MergedColumnParallelLinear(
            dim, [hidden_dim] * 2, bias=False, return_bias=False, prefix=f"{prefix}.linear_in"
        )
        self.linear_out = RowParallelLinear(
            hidden_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.linear_out"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


class Flux2JointAttention(nn.Module):
    """Joint [text, image] attention of a double-stream block (each stream has its own projections)."""

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
        self.num_heads = num_heads // get_tensor_model_parallel_world_size()
        self.to_qkv = QKVParallelLinear(
            dim, head_dim, num_heads, bias=False, return_bias=False, prefix=f"{prefix}.to_qkv"
        )
        self.add_qkv = QKVParallelLinear(
            dim, head_dim, num_heads, bias=False, return_bias=False, prefix=f"{prefix}.add_qkv"
        )
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = RowParallelLinear(
            num_heads * head_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.to_out"
        )
        self.to_add_out = RowParallelLinear(
            num_heads * head_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.to_add_out"
        )
        self.attn = Attention(self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        txt_len = ctx.shape[1]
        cos, sin = rope
        q, k, v = qk_norm_rope(
            self.to_qkv(x),
            (self.norm_q.weight, self.norm_k.weight),
            (cos[txt_len:], sin[txt_len:]),
            txt_qkv=self.add_qkv(ctx),
            txt_norms=(self.norm_added_q.weight, self.norm_added_k.weight),
            txt_rope=(cos[:txt_len], sin[:txt_len]),
            num_heads=self.num_heads,
            eps=self.norm_q.eps,
        )
        out = self.attn(q, k, v, joint_len=txt_len, joint_front=True).flatten(2)
        ctx_out, x_out = out.split([txt_len, x.shape[1]], dim=1)
        return self.to_out(x_out.contiguous()), self.to_add_out(ctx_out.contiguous())


class Flux2TransformerBlock(nn.Module):
    """Double-stream block; `modulation` is (image, text) of the shared (batch, 6 * dim) adaLN parameters."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_ratio: float,
        eps: float,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        self.eps = eps
        self.attn = Flux2JointAttention(dim, num_heads, head_dim, eps, f"{prefix}.attn", attn_config)
        self.ff = Flux2FeedForward(dim, int(dim * mlp_ratio), f"{prefix}.ff")
        self.ff_context = Flux2FeedForward(dim, int(dim * mlp_ratio), f"{prefix}.ff_context")

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, modulation: tuple[torch.Tensor, torch.Tensor], rope: Rope):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation[0].chunk(6, dim=-1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = modulation[1].chunk(6, dim=-1)
        attn_x, attn_ctx = self.attn(
            layer_norm_modulate(x, shift_msa, scale_msa, self.eps),
            layer_norm_modulate(ctx, c_shift_msa, c_scale_msa, self.eps),
            rope,
        )
        x = gated_residual(x, gate_msa, attn_x)
        x = gated_residual(x, gate_mlp, self.ff(layer_norm_modulate(x, shift_mlp, scale_mlp, self.eps)))
        ctx = gated_residual(ctx, c_gate_msa, attn_ctx)
        ctx_ff = self.ff_context(layer_norm_modulate(ctx, c_shift_mlp, c_scale_mlp, self.eps))
        return x, gated_residual(ctx, c_gate_mlp, ctx_ff)


class Flux2SingleAttention(nn.Module):
    """The single-stream block's packed projections and q/k norms (names as in diffusers)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_dim: int,
        eps: float,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        inner = num_heads * head_dim
        self.num_heads = num_heads // tp
        self.mlp_dim = mlp_dim
        self.local_sizes = [inner // tp] * 3 + [mlp_dim // tp] * 2
        self.to_qkv_mlp_proj = MergedColumnParallelLinear(
            dim, [inner] * 3 + [mlp_dim] * 2, bias=False, return_bias=False, prefix=f"{prefix}.to_qkv_mlp_proj"
        )
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = RowParallelLinear(inner + mlp_dim, dim, bias=False, return_bias=False, prefix=f"{prefix}.to_out")
        self.attn = Attention(self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)


class Flux2SingleTransformerBlock(nn.Module):
    """Single-stream block on [text, image]: attention and SwiGLU in parallel off one modulated input."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        mlp_ratio: float,
        eps: float,
        prefix: str,
        attn_config: DiffusionAttentionConfig | None,
    ):
        super().__init__()
        self.eps = eps
        self.attn = Flux2SingleAttention(
            dim, num_heads, head_dim, int(dim * mlp_ratio), eps, f"{prefix}.attn", attn_config
        )

    def forward(self, x: torch.Tensor, modulation: torch.Tensor, rope: Rope, text_len: int) -> torch.Tensor:
        """`modulation` (batch, 3 * dim); `x` starts with `text_len` text tokens (replicated under SP)."""
        shift, scale, gate = modulation.chunk(3, dim=-1)
        attn = self.attn
        proj = attn.to_qkv_mlp_proj(layer_norm_modulate(x, shift, scale, self.eps))
        q, k, v = qk_norm_rope(
            proj, (attn.norm_q.weight, attn.norm_k.weight), rope, num_heads=attn.num_heads, eps=attn.norm_q.eps
        )
        mlp_gate, mlp_up = proj[..., 3 * attn.local_sizes[0] :].chunk(2, dim=-1)
        out = attn.attn(q, k, v, joint_len=text_len, joint_front=True).flatten(2)
        return gated_residual(x, gate, attn.to_out(torch.cat([out, F.silu(mlp_gate) * mlp_up], dim=-1)))


class Flux2Transformer2DModel(nn.Module):
    """Same config keys and forward inputs as diffusers' `Flux2Transformer2DModel` (returns the sample)."""

    _repeated_blocks = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
    _sp_plan: ClassVar[SequencePlan] = {
        "x_embedder": AtOutput(Split(dim=1)),
        "rotary_emb": AtOutput(Split(dim=0, text_from="txt_ids")),  # [text; image] tables: text stays whole
        "proj_out": AtOutput(Gather(dim=1)),
    }
    """Sequence parallel: each rank holds a slice of the image tokens and of their RoPE rows; text stays whole."""

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 128,
        out_channels: int | None = None,
        num_layers: int = 8,
        num_single_layers: int = 48,
        attention_head_dim: int = 128,
        num_attention_heads: int = 48,
        joint_attention_dim: int = 15360,
        timestep_guidance_channels: int = 256,
        mlp_ratio: float = 3.0,
        axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32),
        rope_theta: int = 2000,
        eps: float = 1e-6,
        guidance_embeds: bool = True,
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        # RoPE tables of the joined [text, image] sequence from (tokens, 4) position ids (txt_ids, img_ids).
        self.rotary_emb = JointRope(axes_dims_rope, rope_theta)
        self.guidance_embeds = guidance_embeds
        self.time_guidance_embed = Flux2TimeGuidanceEmbedding(timestep_guidance_channels, dim, guidance_embeds)
        self.double_stream_modulation_img = AdaLNModulation(dim, 6, bias=False)
        self.double_stream_modulation_txt = AdaLNModulation(dim, 6, bias=False)
        self.single_stream_modulation = AdaLNModulation(dim, 3, bias=False)
        self.x_embedder = nn.Linear(in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            Flux2TransformerBlock(
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
        self.single_transformer_blocks = nn.ModuleList(
            Flux2SingleTransformerBlock(
                dim,
                num_attention_heads,
                attention_head_dim,
                mlp_ratio,
                eps,
                f"{prefix}single_transformer_blocks.{i}",
                attn_config,
            )
            for i in range(num_single_layers)
        )
        self.norm_out = AdaLNModulation(dim, 2, bias=False)
        self.eps = eps
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels, bias=False)

    @classmethod
    def from_config(
        cls, config: dict, *, prefix: str = "", attn_config: DiffusionAttentionConfig | None = None
    ) -> Flux2Transformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        code = cls.__init__.__code__
        keys = set(code.co_varnames[1 : code.co_argcount]) - {"prefix", "attn_config"}
        return cls(**{k: v for k, v in config.items() if k in keys}, prefix=prefix, attn_config=attn_config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        rotary_emb: Rope | None = None,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """`timestep` (and `guidance`) as the pipeline passes them (/ 1000); ids (tokens, 4), the same for every
        row (diffusers reads the first row's); `rotary_emb` precomputed from them instead. `cache`: this step's
        view of the request's cache (TeaCache: all blocks run, or the image residual of the last computed step is
        reused; the probe is the first block's modulated image input)."""
        dtype = hidden_states.dtype
        temb = self.time_guidance_embed(
            timestep.to(dtype) * 1000, None if guidance is None else guidance.to(dtype) * 1000
        )
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        x = self.x_embedder(hidden_states)
        ctx = self.context_embedder(encoder_hidden_states)
        text_len = ctx.shape[1]
        rope = rotary_emb if rotary_emb is not None else self.rotary_emb(txt_ids, img_ids)

        def blocks() -> torch.Tensor:
            img, txt = x, ctx
            for block in self.transformer_blocks:
                img, txt = block(img, txt, (mod_img, mod_txt), rope)
            joined = torch.cat([txt, img], dim=1)
            for block in self.single_transformer_blocks:
                joined = block(joined, mod_single, rope, text_len)
            return joined[:, text_len:]

        if cache is None:
            out = blocks()
        else:
            shift0, scale0 = mod_img.chunk(6, dim=-1)[:2]
            out = cache.run(
                x,
                blocks,
                lambda: layer_norm_modulate(x, shift0, scale0, self.eps),
                len(self.transformer_blocks) + len(self.single_transformer_blocks),
            )
        scale, shift = self.norm_out(temb).chunk(2, dim=-1)
        return self.proj_out(layer_norm_modulate(out, shift, scale, self.eps))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors; returns the names of our parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = _map_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard == "packed":  # a diffusers packed column block: one shard per part, in order
                sizes = param.output_sizes if hasattr(param, "output_sizes") else None
                parts = tensor.split(sizes or self._packed_sizes(target), dim=0)
                for i, part in enumerate(parts):
                    loader(param, part, i)
            elif shard is None:
                if target.endswith(".attn.to_out.weight") and target.startswith("single_transformer_blocks."):
                    tensor = self._interleave_packed_columns(tensor)
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        return loaded

    def _packed_sizes(self, target: str) -> list[int]:
        module = self.get_submodule(target.rsplit(".", 1)[0])
        return list(module.output_sizes)

    def _interleave_packed_columns(self, weight: torch.Tensor) -> torch.Tensor:
        """Reorder a single block's to_out [attn | mlp] input columns as [attn_0 | mlp_0 | attn_1 | mlp_1 ...] per
        TP rank, so the row-parallel loader's contiguous slice for rank r is that rank's heads + MLP shard."""
        tp = get_tensor_model_parallel_world_size()
        if tp == 1:
            return weight
        mlp_dim = self.single_transformer_blocks[0].attn.mlp_dim
        attn_cols = weight.shape[1] - mlp_dim
        attn_parts = weight[:, :attn_cols].chunk(tp, dim=1)
        mlp_parts = weight[:, attn_cols:].chunk(tp, dim=1)
        return torch.cat([p for pair in zip(attn_parts, mlp_parts, strict=True) for p in pair], dim=1)


# (diffusers sub-name, our sub-name, shard id) for tensors that land in a fused parameter.
_STACKED = (
    (".attn.to_q.", ".attn.to_qkv.", "q"),
    (".attn.to_k.", ".attn.to_qkv.", "k"),
    (".attn.to_v.", ".attn.to_qkv.", "v"),
    (".attn.add_q_proj.", ".attn.add_qkv.", "q"),
    (".attn.add_k_proj.", ".attn.add_qkv.", "k"),
    (".attn.add_v_proj.", ".attn.add_qkv.", "v"),
)


def _map_name(name: str) -> tuple[str, str | None]:
    for src, dst, shard in _STACKED:
        if src in name:
            return name.replace(src, dst), shard
    if ".linear_in." in name or ".to_qkv_mlp_proj." in name:
        return name, "packed"
    return name.replace(".attn.to_out.0.", ".attn.to_out."), None
