"""FLUX.1 MMDiT transformer (19 double-stream + 38 single-stream blocks), our own modules.

Checkpoint names are diffusers' `FluxTransformer2DModel` names; `load_weights` maps them onto fused vLLM
parallel linears (q/k/v stacked; in single blocks q/k/v and the MLP input share one GEMM). The concatenated
text+image sequence stays concatenated through all single blocks instead of being split and re-joined per block.
"""

from __future__ import annotations

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
from vllm_omni.diffusion.cache.cachedit import IndexedBlock, JoinedBlock
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.distributed.sequence_plan import AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.embeddings import MLPEmbedder, timestep_sinusoid
from vllm_omni.diffusion.layers.gelu_linear import linear_gelu_tanh
from vllm_omni.diffusion.layers.modulation import AdaLNModulation, gated_residual, layer_norm_modulate
from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope
from vllm_omni.diffusion.layers.rope import JointRope
from vllm_omni.diffusion.model_loader.weight_utils import default_weight_loader

RotaryEmb = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) per channel pair, (text + image tokens, head_dim / 2), float32."""
FluxModulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Every adaLN parameter of one forward: double blocks (num_layers, 2, batch, 6 * dim) [image, text], single
blocks (num_single_layers, batch, 3 * dim), final norm (batch, 2 * dim)."""


class FluxTimeTextEmbedding(nn.Module):
    """timestep (+ distilled guidance) sinusoids through MLPs, plus the pooled CLIP projection."""

    def __init__(self, dim: int, pooled_projection_dim: int, guidance_embeds: bool):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        self.guidance_embedder = MLPEmbedder(256, dim) if guidance_embeds else None
        self.text_embedder = MLPEmbedder(pooled_projection_dim, dim)

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError("this FLUX transformer is guidance-distilled: `guidance` is required")
            emb = emb + self.guidance_embedder(timestep_sinusoid(guidance).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


class FluxFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, prefix: str):
        super().__init__()
        self.proj_in = ColumnParallelLinear(dim, hidden_dim, bias=True, prefix=f"{prefix}.proj_in")
        self.proj_out = RowParallelLinear(hidden_dim, dim, bias=True, prefix=f"{prefix}.proj_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(linear_gelu_tanh(self.proj_in, x))[0]


class FluxJointAttention(nn.Module):
    """Joint text+image attention of a double-stream block (each stream has its own projections)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None = None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.local_dim = num_heads // tp * head_dim
        self.to_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, prefix=f"{prefix}.to_qkv")
        self.add_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, prefix=f"{prefix}.add_qkv")
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.to_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, prefix=f"{prefix}.to_out")
        self.to_add_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, prefix=f"{prefix}.to_add_out")
        self.attn = Attention(num_heads // tp, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: RotaryEmb) -> tuple[torch.Tensor, torch.Tensor]:
        txt_len = ctx.shape[1]
        cos, sin = rope
        q, k, v = qk_norm_rope(
            self.to_qkv(x)[0], (self.norm_q.weight, self.norm_k.weight), (cos[txt_len:], sin[txt_len:]),
            txt_qkv=self.add_qkv(ctx)[0], txt_norms=(self.norm_added_q.weight, self.norm_added_k.weight),
            txt_rope=(cos[:txt_len], sin[:txt_len]), num_heads=self.local_dim // self.head_dim, eps=self.norm_q.eps,
        )
        out = self.attn(q, k, v, joint_len=txt_len, joint_front=True).flatten(2)
        ctx_out, x_out = out.split([txt_len, x.shape[1]], dim=1)
        return self.to_out(x_out.contiguous())[0], self.to_add_out(ctx_out.contiguous())[0]


class FluxTransformerBlock(nn.Module):
    """Double-stream block: separate adaLN/MLP weights per stream, one joint attention."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None = None):
        super().__init__()
        self.norm1 = AdaLNModulation(dim, 6)
        self.norm1_context = AdaLNModulation(dim, 6)
        self.attn = FluxJointAttention(dim, num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)
        self.ff = FluxFeedForward(dim, 4 * dim, prefix=f"{prefix}.ff")
        self.ff_context = FluxFeedForward(dim, 4 * dim, prefix=f"{prefix}.ff_context")

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, modulation: torch.Tensor, rope: RotaryEmb):
        """`modulation` (2, batch, 6 * dim): this block's image and text adaLN parameters."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation[0].chunk(6, dim=-1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = modulation[1].chunk(6, dim=-1)
        attn_x, attn_ctx = self.attn(
            layer_norm_modulate(x, shift_msa, scale_msa), layer_norm_modulate(ctx, c_shift_msa, c_scale_msa), rope
        )
        x = gated_residual(x, gate_msa, attn_x)
        x = gated_residual(x, gate_mlp, self.ff(layer_norm_modulate(x, shift_mlp, scale_mlp)))
        ctx = gated_residual(ctx, c_gate_msa, attn_ctx)
        ctx = gated_residual(ctx, c_gate_mlp, self.ff_context(layer_norm_modulate(ctx, c_shift_mlp, c_scale_mlp)))
        return x, ctx


class FluxSingleAttention(nn.Module):
    """Holds the per-head q/k norms and the attention op of a single-stream block (names as in diffusers)."""

    def __init__(self, num_heads: int, head_dim: int, prefix: str, attn_config: DiffusionAttentionConfig | None = None):
        super().__init__()
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.attn = Attention(num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block on the joined sequence: attention and MLP run in parallel off one modulated input."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, prefix: str,
                 attn_config: DiffusionAttentionConfig | None = None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.mlp_dim = int(dim * mlp_ratio)
        inner = num_heads * head_dim
        self.local_sizes = [inner // tp] * 3 + [self.mlp_dim // tp]
        self.norm = AdaLNModulation(dim, 3)
        self.to_qkv_mlp = MergedColumnParallelLinear(
            dim, [inner, inner, inner, self.mlp_dim], bias=True, prefix=f"{prefix}.to_qkv_mlp"
        )
        self.attn = FluxSingleAttention(num_heads // tp, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)
        self.proj_out = RowParallelLinear(inner + self.mlp_dim, dim, bias=True, prefix=f"{prefix}.proj_out")

    def forward(self, x: torch.Tensor, modulation: torch.Tensor, rope: RotaryEmb, text_len: int = 0
                ) -> torch.Tensor:
        """`modulation` (batch, 3 * dim): this block's adaLN parameters; `x` starts with `text_len` text tokens
        (replicated on every sequence-parallel rank)."""
        shift, scale, gate = modulation.chunk(3, dim=-1)
        qkv_mlp = self.to_qkv_mlp(layer_norm_modulate(x, shift, scale))[0]
        q, k, v = qk_norm_rope(qkv_mlp, (self.attn.norm_q.weight, self.attn.norm_k.weight), rope,
                               num_heads=self.local_sizes[0] // self.head_dim, eps=self.attn.norm_q.eps)
        mlp = qkv_mlp[..., 3 * self.local_sizes[0]:]
        out = self.attn.attn(q, k, v, joint_len=text_len, joint_front=True).flatten(2)
        out = self.proj_out(torch.cat([out, F.gelu(mlp, approximate="tanh")], dim=-1))[0]
        return gated_residual(x, gate, out)


class FluxTransformer2DModel(nn.Module):
    """Same config signature and forward inputs as diffusers' `FluxTransformer2DModel` (return: the sample)."""

    _repeated_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    _sp_plan: ClassVar[SequencePlan] = {
        "x_embedder": AtOutput(Split(dim=1)),
        "rotary_emb": AtOutput(Split(dim=0, text_from="txt_ids")),  # [text; image] tables: text stays whole
        "proj_out": AtOutput(Gather(dim=1)),
    }
    """Sequence parallel: each rank holds a slice of the image tokens and of their RoPE rows; text stays whole."""

    def __init__(
        self,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: tuple[int, ...] = (16, 56, 56),
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.out_channels = out_channels or in_channels
        # RoPE tables of the joined [text, image] sequence from (txt_ids, img_ids); callers may compute them once
        # per request.
        self.rotary_emb = JointRope(axes_dims_rope, 10000.0)
        self.guidance_embeds = guidance_embeds
        self.time_text_embed = FluxTimeTextEmbedding(dim, pooled_projection_dim, guidance_embeds)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.x_embedder = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            FluxTransformerBlock(dim, num_attention_heads, attention_head_dim, prefix=f"{prefix}transformer_blocks.{i}",
                                 attn_config=attn_config)
            for i in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleTransformerBlock(
                dim, num_attention_heads, attention_head_dim, 4.0, prefix=f"{prefix}single_transformer_blocks.{i}",
                attn_config=attn_config,
            )
            for i in range(num_single_layers)
        )
        self.norm_out = AdaLNModulation(dim, 2)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * self.out_channels)

    @classmethod
    def from_config(cls, config: dict, *, prefix: str = "",
                    attn_config: DiffusionAttentionConfig | None = None) -> FluxTransformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        keys = set(cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]) - {"prefix", "attn_config"}
        return cls(**{k: v for k, v in config.items() if k in keys}, prefix=prefix, attn_config=attn_config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        rotary_emb: RotaryEmb | None = None,
        modulation: FluxModulation | None = None,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """`modulation`: this step's slice of `step_modulation(...)` when the caller computed it ahead (then
        `timestep`, `guidance` and `pooled_projections` are not read); None = computed here.
        `cache`: this step's view of the request's cache (TeaCache: the double and single blocks run, or the
        image residual they left at the last computed step is reused; the probe is block 0's modulated input)."""
        x = self.x_embedder(hidden_states)
        if modulation is None:
            modulation = self.block_modulation(self.temb(timestep, guidance, pooled_projections, x.dtype))
        double, single, final = modulation
        ctx = self.context_embedder(encoder_hidden_states)
        rope = rotary_emb if rotary_emb is not None else self.rotary_emb(txt_ids, img_ids)

        text_len = ctx.shape[1]

        def blocks() -> torch.Tensor:
            img, txt = x, ctx
            if "cache_dit_double" in self._modules:  # the cache-dit backend: inside its forward, its cached blocks
                for blocks, table in ((self.cache_dit_double, double), (self.cache_dit_single, single)):
                    for block in blocks:
                        img, txt = block(img, txt, table, rope)
                return img
            for block, block_modulation in zip(self.transformer_blocks, double, strict=True):
                img, txt = block(img, txt, block_modulation, rope)
            joined = torch.cat([txt, img], dim=1)
            for block, block_modulation in zip(self.single_transformer_blocks, single, strict=True):
                joined = block(joined, block_modulation, rope, text_len)
            return joined[:, text_len:]

        if cache is None:
            out = blocks()
        else:
            num_blocks = len(self.transformer_blocks) + len(self.single_transformer_blocks)
            shift0, scale0 = double[0][0].chunk(6, dim=-1)[:2]
            out = cache.run(x, blocks, lambda: layer_norm_modulate(x, shift0, scale0), num_blocks)
        scale, shift = final.chunk(2, dim=1)
        return self.proj_out(layer_norm_modulate(out, shift, scale))

    def cache_dit_block_lists(self) -> dict[str, tuple[nn.ModuleList, int]]:
        """What the cache-dit backend caches: {attribute: (blocks, cache-dit forward pattern)}."""
        double = self._modules.get("cache_dit_double") or nn.ModuleList(
            IndexedBlock(block, i) for i, block in enumerate(self.transformer_blocks))
        single = self._modules.get("cache_dit_single") or nn.ModuleList(
            JoinedBlock(block, i) for i, block in enumerate(self.single_transformer_blocks))
        return {"cache_dit_double": (double, 0), "cache_dit_single": (single, 0)}

    def temb(self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
        """The conditioning vector (batch, dim); `timestep` and `guidance` as the pipeline passes them (/ 1000)."""
        return self.time_text_embed(timestep.to(dtype) * 1000, None if guidance is None else guidance.to(dtype) * 1000,
                                    pooled)

    def block_modulation(self, temb: torch.Tensor) -> FluxModulation:
        """Every block's adaLN parameters for the conditioning `temb` (rows, dim).

        They depend on the timestep, the guidance and the pooled prompt only: a denoise loop computes them for
        all its steps at once (`step_modulation`), one GEMM per block with a row per step instead of, every
        step, 77 GEMVs that re-read 6.5 GB of weights (~1.8 ms of a 126 ms 1024² forward on an H200).
        """
        double = torch.stack([torch.stack([block.norm1(temb), block.norm1_context(temb)])
                              for block in self.transformer_blocks])
        single = torch.stack([block.norm(temb) for block in self.single_transformer_blocks])
        return double, single, self.norm_out(temb)

    def step_modulation(self, timesteps: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor,
                        dtype: torch.dtype) -> FluxModulation:
        """`block_modulation` for each step: `timesteps` (steps, batch) as each step's forward would get them;
        the batch dimension becomes (steps, batch). Step `i`'s forward takes `step_slice(table, i)`."""
        steps, batch = timesteps.shape

        def per_step(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat(steps, *([1] * (t.dim() - 1)))

        temb = self.temb(timesteps.reshape(-1), per_step(guidance), per_step(pooled), dtype)
        double, single, final = self.block_modulation(temb)
        return (double.unflatten(2, (steps, batch)), single.unflatten(1, (steps, batch)),
                final.unflatten(0, (steps, batch)))

    @staticmethod
    def step_slice(table: FluxModulation, step: int) -> FluxModulation:
        double, single, final = table
        return double[:, :, step], single[:, step], final[step]

    def lora_target(self, module: str) -> tuple[str, str | int | None]:
        """Our linear computing diffusers module `module` (a LoRA target) and its slice when fused. The adaLN
        modulation and its conditioning vector are computed once per request group for all steps
        (`step_modulation`), not per transformer row, so a LoRA on them cannot be per request: refused."""
        if module.startswith(("time_text_embed.", "norm_out.")) or \
                module.endswith((".norm1.linear", ".norm1_context.linear", ".norm.linear")):
            raise ValueError(f"{module} (adaLN modulation, computed once per request group) takes no "
                             "per-request LoRA")
        target, shard = _map_name(module + ".weight")
        return target.removesuffix(".weight"), shard

    def lora_down_columns(self, target: str, down: torch.Tensor) -> torch.Tensor:
        """A LoRA down-projection in the input column order of our `target` (a single block's proj_out takes
        [attn | mlp] interleaved per TP rank, as `load_weights` reorders its weight)."""
        if target.startswith("single_transformer_blocks.") and target.endswith(".proj_out"):
            return self._interleave_packed_columns(down)
        return down

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named tensors; returns the names of our parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = _map_name(name)
            if target.startswith("single_transformer_blocks.") and target.endswith(".proj_out.weight"):
                tensor = self._interleave_packed_columns(tensor)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        return loaded

    def _interleave_packed_columns(self, weight: torch.Tensor) -> torch.Tensor:
        """Reorder proj_out's [attn | mlp] input columns as [attn_0 | mlp_0 | attn_1 | mlp_1 ...] per TP rank,
        so the row-parallel loader's contiguous slice for rank r is exactly that rank's attention heads + MLP."""
        tp = get_tensor_model_parallel_world_size()
        if tp == 1:
            return weight
        block = self.single_transformer_blocks[0]
        attn_cols = weight.shape[1] - block.mlp_dim
        attn_parts = weight[:, :attn_cols].chunk(tp, dim=1)
        mlp_parts = weight[:, attn_cols:].chunk(tp, dim=1)
        return torch.cat([p for pair in zip(attn_parts, mlp_parts, strict=True) for p in pair], dim=1)


# (diffusers sub-name, our sub-name, shard id) for tensors that land in a fused parameter.
_DOUBLE_STACKED = (
    (".attn.to_q.", ".attn.to_qkv.", "q"),
    (".attn.to_k.", ".attn.to_qkv.", "k"),
    (".attn.to_v.", ".attn.to_qkv.", "v"),
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
    stacked = _SINGLE_STACKED if name.startswith("single_transformer_blocks.") else _DOUBLE_STACKED
    for src, dst, shard in stacked:
        if src in name:
            return name.replace(src, dst), shard
    for src, dst in _RENAMES:
        if src in name:
            return name.replace(src, dst), None
    return name, None
