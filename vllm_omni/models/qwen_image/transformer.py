"""Qwen-Image MMDiT: a dual-stream (image + text) transformer with joint attention.

Module and parameter names follow diffusers' `QwenImageTransformer2DModel` so its checkpoints load by name;
the projections are vLLM parallel linears (q/k/v fused per stream) so the blocks can be sharded by tensor
parallelism, and attention goes through our `Attention` layer. Inputs are packed 2x2 latent patches.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig
from vllm_omni.diffusion.cache.cachedit import IndexedBlock
from vllm_omni.diffusion.cache.state import BlockCache
from vllm_omni.diffusion.distributed.sequence_plan import AtOutput, Gather, SequencePlan, Split
from vllm_omni.diffusion.layers.gelu_linear import linear_gelu_tanh
from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope
from vllm_omni.diffusion.model_loader.weight_utils import default_weight_loader

ImageShapes = list[list[tuple[int, int, int]]]
"""Per sample: (frames, height, width) in patches of every image in the sequence (target first)."""
RopeTables = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin) float32 (tokens, head_dim / 2): the rotation of each adjacent channel pair."""


@dataclass
class QwenImageTransformerConfig:
    """The diffusers `config.json` of `transformer/` (same field names and defaults)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> QwenImageTransformerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in config if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"unsupported QwenImageTransformer2DModel config keys: {unknown}")
        self = cls(**{k: v for k, v in config.items() if k in known})
        # Variants (Edit-2511 zero-cond, layered, guidance-distilled) are other models; refuse them loudly.
        for flag in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if getattr(self, flag):
                raise NotImplementedError(f"QwenImageTransformer2DModel with {flag}=True is not supported")
        return self

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return x.to(self.weight.dtype) * self.weight


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def timestep_sinusoids(timesteps: torch.Tensor, dim: int = 256, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal timestep features, cos half first (diffusers `Timesteps(flip_sin_to_cos=True, shift=0)`)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    freqs = freqs.to(timesteps.dtype)
    angles = scale * (timesteps[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, dim: int, prefix: str) -> None:
        super().__init__()
        self.linear_1 = ReplicatedLinear(in_channels, dim, bias=True, return_bias=False, prefix=f"{prefix}.linear_1")
        self.linear_2 = ReplicatedLinear(dim, dim, bias=True, return_bias=False, prefix=f"{prefix}.linear_2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class QwenTimestepProjEmbeddings(nn.Module):
    def __init__(self, dim: int, prefix: str) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim, prefix=f"{prefix}.timestep_embedder")

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoids(timestep).to(dtype))


class QwenEmbedRope(nn.Module):
    """3-axis rotary angles (frame, height, width) for image tokens, centred on the image; text after them.

    Image `i` of a sample sits at frame index `i`; text positions start past the largest half-extent of the
    images, so text and image positions never collide. Tables are cached per shape and device (the most
    recent `max_cached` of them, so a server seeing many sizes and prompt lengths stays bounded).
    """

    max_cached = 64

    def __init__(self, axes_dim: tuple[int, int, int], theta: float = 10000.0) -> None:
        super().__init__()
        self.axes_dim = tuple(axes_dim)
        # On the CPU whatever device the model is built on: positions are made there too, tables moved once.
        self.inv_freqs = [1.0 / torch.pow(theta, torch.arange(0, d, 2, device="cpu").to(torch.float32).div(d))
                          for d in axes_dim]
        self._cache: OrderedDict[tuple, tuple[RopeTables, RopeTables]] = OrderedDict()

    def _angles(self, positions: list[torch.Tensor]) -> torch.Tensor:
        """Per-token angles (tokens, head_dim/2) from per-axis integer positions (tokens,)."""
        return torch.cat([torch.outer(p, f) for p, f in zip(positions, self.inv_freqs, strict=True)], dim=-1)

    def forward(self, shapes: list[tuple[int, int, int]], txt_len: int, device: torch.device
                ) -> tuple[RopeTables, RopeTables]:
        """((cos, sin) of the image tokens, (cos, sin) of the text tokens)."""
        key = (tuple(shapes), txt_len, device)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            image_angles, max_index = [], 0
            for idx, (frame, height, width) in enumerate(shapes):
                f = torch.arange(idx, idx + frame, device="cpu")
                h = torch.arange(height, device="cpu") - (height - height // 2)
                w = torch.arange(width, device="cpu") - (width - width // 2)
                grid = torch.meshgrid(f, h, w, indexing="ij")
                image_angles.append(self._angles([g.reshape(-1) for g in grid]))
                max_index = max(max_index, height // 2, width // 2)
            txt_pos = torch.arange(max_index, max_index + txt_len, device="cpu")
            txt_angles = self._angles([txt_pos] * 3)
            # cos/sin of the same complex unit numbers diffusers builds with torch.polar.
            self._cache[key] = tuple(
                (a.cos().to(device), a.sin().to(device)) for a in (torch.cat(image_angles), txt_angles)
            )
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return self._cache[key]


class QwenJointAttention(nn.Module):
    """q/k/v of both streams, per-head RMS norm, RoPE, one joint attention, two out projections.

    The joint sequence is image tokens then text tokens. Padded text is left out in one of two ways
    (`txt_padding`): per-row real-token counts (a tuple), each such row then running its own unmasked attention
    over a prefix of the sequence; or a (batch, joint_seq) boolean key mask, one masked attention for the batch
    that reads nothing on the host (the compiled path: text padded to a length bucket, so one CUDA graph serves
    every prompt length in it). Attention does not depend on token order (positions are in the RoPE tables), so
    both equal diffusers' text-first masked attention on every real token.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = num_heads // tp
        self.head_dim = head_dim
        self.to_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, return_bias=False,
                                        prefix=f"{prefix}.to_qkv")
        self.add_qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=True, return_bias=False,
                                         prefix=f"{prefix}.add_qkv")
        self.norm_q = RMSNorm(head_dim)
        self.norm_k = RMSNorm(head_dim)
        self.norm_added_q = RMSNorm(head_dim)
        self.norm_added_k = RMSNorm(head_dim)
        self.to_out = nn.ModuleList([RowParallelLinear(num_heads * head_dim, dim, bias=True, return_bias=False,
                                                       prefix=f"{prefix}.to_out.0")])
        self.to_add_out = RowParallelLinear(num_heads * head_dim, dim, bias=True, return_bias=False,
                                            prefix=f"{prefix}.to_add_out")
        self.attn = Attention(self.num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, txt_padding: tuple[int, ...] | torch.Tensor | None,
                rope: tuple[RopeTables, RopeTables]) -> tuple[torch.Tensor, torch.Tensor]:
        img_rope, txt_rope = rope
        q, k, v = qk_norm_rope(
            self.to_qkv(img), (self.norm_q.weight, self.norm_k.weight), img_rope,
            txt_qkv=self.add_qkv(txt), txt_norms=(self.norm_added_q.weight, self.norm_added_k.weight),
            txt_rope=txt_rope, num_heads=self.num_heads, eps=self.norm_q.eps, text_first=False,
        )
        img_len = img.shape[1]
        if txt_padding is None or isinstance(txt_padding, torch.Tensor):
            out = self.attn(q, k, v, attn_mask=txt_padding, joint_len=txt.shape[1])
        else:
            # Padded positions (past a row's prefix) get zeros; nothing real attends to them.
            out = torch.cat([
                F.pad(self.attn(q[b : b + 1, :img_len + n], k[b : b + 1, :img_len + n],
                                v[b : b + 1, :img_len + n], attn_mask=None, joint_len=n),
                      (0, 0, 0, 0, 0, q.shape[1] - img_len - n))
                for b, n in enumerate(txt_padding)
            ])
        out = out.flatten(2)
        return self.to_out[0](out[:, :img_len]), self.to_add_out(out[:, img_len:])


class FeedForward(nn.Module):
    """dim -> 4*dim (tanh GELU) -> dim, named like diffusers' `FeedForward` (`net.0.proj`, `net.2`)."""

    def __init__(self, dim: int, prefix: str) -> None:
        super().__init__()
        self.net = nn.ModuleList([
            _GeluProj(dim, 4 * dim, prefix=f"{prefix}.net.0"),
            nn.Identity(),
            RowParallelLinear(4 * dim, dim, bias=True, return_bias=False, prefix=f"{prefix}.net.2"),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class _GeluProj(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, prefix: str) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(dim_in, dim_out, bias=True, gather_output=False, return_bias=False,
                                         prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu_tanh(self.proj, x)


class _Modulation(nn.Module):
    """SiLU + linear producing (shift, scale, gate) for the attention and the MLP half of a block."""

    def __init__(self, dim: int, prefix: str) -> None:
        super().__init__()
        self.act = nn.SiLU()
        self.linear = ReplicatedLinear(dim, 6 * dim, bias=True, return_bias=False, prefix=prefix)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(self.act(temb))


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, prefix: str,
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        self.img_mod = _Modulation(dim, prefix=f"{prefix}.img_mod.1")
        self.txt_mod = _Modulation(dim, prefix=f"{prefix}.txt_mod.1")
        self.attn = QwenJointAttention(dim, num_heads, head_dim, prefix=f"{prefix}.attn", attn_config=attn_config)
        self.img_mlp = FeedForward(dim, prefix=f"{prefix}.img_mlp")
        self.txt_mlp = FeedForward(dim, prefix=f"{prefix}.txt_mlp")

    def forward(self, img: torch.Tensor, txt: torch.Tensor, modulation: torch.Tensor,
                txt_padding: tuple[int, ...] | torch.Tensor | None, rope: tuple[RopeTables, RopeTables]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`modulation` (2, batch or 1, 6 * dim): this block's image and text adaLN parameters; `txt_padding`
        as in `QwenJointAttention`."""
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = modulation[0][:, None, :].chunk(6, dim=-1)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = modulation[1][:, None, :].chunk(6, dim=-1)
        img_attn, txt_attn = self.attn(
            _layer_norm(img) * (1 + i_scale1) + i_shift1,
            _layer_norm(txt) * (1 + t_scale1) + t_shift1,
            txt_padding,
            rope,
        )
        img = img + i_gate1 * img_attn
        txt = txt + t_gate1 * txt_attn
        img = img + i_gate2 * self.img_mlp(_layer_norm(img) * (1 + i_scale2) + i_shift2)
        txt = txt + t_gate2 * self.txt_mlp(_layer_norm(txt) * (1 + t_scale2) + t_shift2)
        if img.dtype == torch.float16:
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


class _AdaNormOut(nn.Module):
    """Final adaptive LayerNorm: (scale, shift) from the timestep embedding (diffusers order: scale first)."""

    def __init__(self, dim: int, prefix: str) -> None:
        super().__init__()
        self.linear = ReplicatedLinear(dim, 2 * dim, bias=True, return_bias=False, prefix=f"{prefix}.linear")

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype))[:, None, :].chunk(2, dim=-1)
        return _layer_norm(x) * (1 + scale) + shift


class QwenImageTransformer2DModel(nn.Module):
    _no_split_modules = ["QwenImageTransformerBlock"]
    _repeated_blocks = ["QwenImageTransformerBlock"]
    _sp_plan: ClassVar[SequencePlan] = {
        "img_in": AtOutput(Split(dim=1)),
        "pos_embed": AtOutput((Split(dim=0), None)),  # ((image cos, sin), text tables): text stays whole
        "proj_out": AtOutput(Gather(dim=1)),
    }
    """Sequence parallel: each rank holds a slice of the image tokens and of their RoPE rows; text stays whole."""
    # diffusers checkpoint names -> our fused q/k/v parameters.
    stacked_params_mapping = [
        (".to_qkv", ".to_q", "q"), (".to_qkv", ".to_k", "k"), (".to_qkv", ".to_v", "v"),
        (".add_qkv", ".add_q_proj", "q"), (".add_qkv", ".add_k_proj", "k"), (".add_qkv", ".add_v_proj", "v"),
    ]

    def __init__(self, *, config: QwenImageTransformerConfig, prefix: str = "",
                 attn_config: DiffusionAttentionConfig | None = None) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.out_channels = config.out_channels or config.in_channels
        self.pos_embed = QwenEmbedRope(config.axes_dims_rope)
        self.time_text_embed = QwenTimestepProjEmbeddings(dim, prefix="time_text_embed")
        self.txt_norm = RMSNorm(config.joint_attention_dim)
        self.img_in = ReplicatedLinear(config.in_channels, dim, bias=True, return_bias=False, prefix="img_in")
        self.txt_in = ReplicatedLinear(config.joint_attention_dim, dim, bias=True, return_bias=False,
                                       prefix="txt_in")
        self.transformer_blocks = nn.ModuleList([
            QwenImageTransformerBlock(dim, config.num_attention_heads, config.attention_head_dim,
                                      prefix=f"transformer_blocks.{i}", attn_config=attn_config)
            for i in range(config.num_layers)
        ])
        self.norm_out = _AdaNormOut(dim, prefix="norm_out")
        self.proj_out = ReplicatedLinear(dim, config.patch_size**2 * self.out_channels, bias=True,
                                         return_bias=False, prefix="proj_out")

    @classmethod
    def from_config(cls, config: dict, *, prefix: str = "",
                    attn_config: DiffusionAttentionConfig | None = None) -> QwenImageTransformer2DModel:
        """From the component's config.json contents (the `load_native_transformer` contract)."""
        return cls(config=QwenImageTransformerConfig.from_dict(config), prefix=prefix, attn_config=attn_config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        modulation: torch.Tensor | None = None,
        txt_lengths: tuple[int, ...] | None = None,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """Predict the flow for packed latents (batch, img_seq, in_channels).

        `img_shapes` is shared by the whole batch (the scheduler only co-batches same-size requests).
        Rows whose prompt is shorter than `txt_seq` are padded: `encoder_hidden_states_mask` (batch, txt_seq)
        bool marks each row's real text tokens, as in diffusers; it becomes the attention's key mask, read only
        on the device (what a CUDA graph needs), when `masks_on_device`. Otherwise (a backend without masks,
        sequence parallelism) it must mark real tokens first and is read on the host as `txt_lengths`: each
        row's real text tokens at the start (None = all real), which eager callers that know them pass instead.
        `timestep` is in [0, 1] (diffusers pipelines pass t / 1000). `modulation` is this step's slice of
        `block_modulation(...)` when the caller computed it ahead; None = computed here from `timestep`.
        `cache`: this step's view of the request's cache (TeaCache over the image stream: the blocks run, or the
        image residual they left at the last computed step is reused; the probe is block 0's modulated input).
        """
        img = self.img_in(hidden_states)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_text_embed(timestep.to(img.dtype), img.dtype)
        if modulation is None:
            modulation = self.block_modulation(temb)
        rope = self.pos_embed(img_shapes, txt.shape[1], img.device)
        txt_padding: tuple[int, ...] | torch.Tensor | None = txt_lengths
        if txt_lengths is None and encoder_hidden_states_mask is not None:
            if self.masks_on_device:
                # Joint key mask: every image token, then the text's own mask.
                txt_padding = F.pad(encoder_hidden_states_mask.bool(), (img.shape[1], 0), value=True)
            else:
                txt_padding = padding_lengths(encoder_hidden_states_mask)
        if isinstance(txt_padding, tuple) and all(n == txt.shape[1] for n in txt_padding):
            txt_padding = None

        def blocks() -> torch.Tensor:
            out, stream = img, txt
            wrapped = self._modules.get("cache_dit_blocks")
            if wrapped is not None:  # the cache-dit backend: inside its forward these are its cached blocks
                for block in wrapped:
                    out, stream = block(out, stream, modulation, txt_padding, rope)
                return out
            for block, block_modulation in zip(self.transformer_blocks, modulation, strict=True):
                out, stream = block(out, stream, block_modulation, txt_padding, rope)
            return out

        if cache is None:
            img = blocks()
        else:
            img = cache.run(img, blocks, lambda: self._probe(img, modulation[0][0]), len(self.transformer_blocks))
        return self.proj_out(self.norm_out(img, temb))

    @property
    def masks_on_device(self) -> bool:
        """Whether a text mask runs as the attention's key mask (the backend takes masks, no sequence
        parallelism) rather than being read on the host as per-row lengths."""
        attn = self.transformer_blocks[0].attn.attn
        return attn.attn_backend.supports_attention_mask() and attn.sp_groups is None

    @staticmethod
    def _probe(img: torch.Tensor, img_modulation: torch.Tensor) -> torch.Tensor:
        """Block 0's modulated image input: what TeaCache compares between steps."""
        shift, scale = img_modulation[:, None, :].chunk(6, dim=-1)[:2]
        return _layer_norm(img) * (1 + scale) + shift

    def cache_dit_block_lists(self) -> dict[str, tuple[nn.ModuleList, int]]:
        """What the cache-dit backend caches: {attribute: (blocks, cache-dit forward pattern)}."""
        blocks = self._modules.get("cache_dit_blocks") or nn.ModuleList(
            IndexedBlock(block, i) for i, block in enumerate(self.transformer_blocks))
        return {"cache_dit_blocks": (blocks, 0)}

    def block_modulation(self, temb: torch.Tensor) -> torch.Tensor:
        """Every block's image and text adaLN parameters, (num_layers, 2, *temb.shape[:-1], 6 * dim).

        They depend on the timestep alone. A denoise loop computes them for all its steps at once
        (`step_modulation`): one GEMM per block with a row per step replaces, every step, 120 GEMVs that
        each re-read a 113 MB weight (3.7 ms of a 35 ms 512² forward on an H200).
        """
        return torch.stack([torch.stack([block.img_mod(temb), block.txt_mod(temb)])
                            for block in self.transformer_blocks])

    def step_modulation(self, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`block_modulation` for each of `timesteps` (steps,), in [0, 1]: (num_layers, 2, steps, 6 * dim)."""
        return self.block_modulation(self.time_text_embed(timesteps.to(dtype), dtype))

    def lora_target(self, module: str) -> tuple[str, str | None]:
        """Our linear computing diffusers module `module` (a LoRA target) and its q/k/v slice when fused.
        The adaLN modulation is computed once per request group for all steps (`step_modulation`), not per
        transformer row, so a LoRA on it cannot be per request: refused (ValueError)."""
        if module.startswith("time_text_embed.") or ".img_mod." in module or ".txt_mod." in module:
            raise ValueError(f"{module} (adaLN modulation, computed once per request group) takes no "
                             "per-request LoRA")
        name = _rename(module + ".")[:-1]
        for ours, theirs, shard in self.stacked_params_mapping:
            if name.endswith(theirs):
                return name.removesuffix(theirs) + ours, shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load diffusers-named weights; returns the names of our parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _rename(name)
            for ours, theirs, shard in self.stacked_params_mapping:
                if theirs in name:
                    target = name.replace(theirs, ours)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r} for QwenImageTransformer2DModel")
                target = name
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded


def padding_lengths(mask: torch.Tensor) -> tuple[int, ...]:
    """Real tokens per row of a (batch, seq) mask that pads at the end; refuses any other mask."""
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]):
        raise ValueError("encoder_hidden_states_mask must mark each row's real tokens first, then padding")
    return tuple(lengths.tolist())


def _rename(name: str) -> str:
    """diffusers names -> ours where the module path differs (mod Sequential index)."""
    return name.replace(".img_mod.1.", ".img_mod.linear.").replace(".txt_mod.1.", ".txt_mod.linear.")
