"""DiT transformer-forward latency: our native transformers vs diffusers, same process, same random weights.

Builds the real-size configs (FLUX.1-dev 11.9B, Qwen-Image 20.4B, Z-Image-Turbo 6B, FLUX.2 klein 4B, Qwen-Image-2.1,
HunyuanImage-2.1 17B)
with random bf16 weights directly on the GPU,
copies diffusers' state_dict into ours through our name-mapping loaders, then times every variant of ours
(attention kernels, regional torch.compile, CUDA-graph replay) against diffusers' eager forward and, on CUDA
(`--diffusers-compiled`, on by default), against diffusers with `compile_repeated_blocks` (its own regional
torch.compile, what a user who knows diffusers runs). Prints a table (ms, TFLOP/s from FlopCounterMode, % of a
bf16 matmul peak measured in the same run, speed-up against both references, PSNR vs diffusers and vs our eager
path) and writes JSON. `--smoke` runs tiny configs on the CPU in seconds.

  python benchmarks/diffusion/bench_dit_forward.py --models flux qwen-image --sizes 1024 512 --out res.json
  python benchmarks/diffusion/bench_dit_forward.py --models z-image flux2-klein qwen-image-2.1 --sizes 1024 \
      --out new.json
  python benchmarks/diffusion/bench_dit_forward.py --models hunyuan-image-2.1 --sizes 1024 --out hunyuan.json

HunyuanImage-2.1 is timed as each pipeline calls its DiT: diffusers over the prompt padded to 1000 + 128 tokens under
a mask, ours over the real tokens only (`hunyuan_image_21_inputs`).

Qwen-Image-2.1 is timed at a steady denoise step: diffusers' "cached" step (its prefix K/V stored by one "extract"
call before timing) against our forward over the request's precomputed text K/V (`prefix_kv`, also outside).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

# Real transformer configs (diffusers `transformer/config.json`) and tiny ones for --smoke.
FLUX_CONFIG = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
QWEN_CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# Z-Image-Turbo, FLUX.2 [klein] 4B and Qwen-Image-2.1 as their repos' transformer/config.json give them (klein and
# 2.1: check against the repo before quoting; diffusers' class defaults are FLUX.2 dev's / 2.1's).
ZIMAGE_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))
FLUX2_KLEIN_CONFIG = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                          num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
                          mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                          guidance_embeds=False)
QWEN21_CONFIG = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                     num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56))
HUNYUAN21_CONFIG = dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128, num_layers=20,
                        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1),
                        qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584, text_embed_2_dim=1472,
                        rope_theta=256.0, rope_axes_dim=(64, 64), use_meanflow=False)
CONFIGS = {"flux": FLUX_CONFIG, "qwen-image": QWEN_CONFIG, "z-image": ZIMAGE_CONFIG,
           "flux2-klein": FLUX2_KLEIN_CONFIG, "qwen-image-2.1": QWEN21_CONFIG, "hunyuan-image-2.1": HUNYUAN21_CONFIG}
STEP_TABLE_MODELS = ("flux", "qwen-image")
"""Families whose forward takes a per-request adaLN step table (the "+ step table" variant)."""
SMOKE = {
    "flux": dict(FLUX_CONFIG, num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 12, 12)),
    "qwen-image": dict(QWEN_CONFIG, num_layers=2, attention_head_dim=32, num_attention_heads=2,
                       joint_attention_dim=32, axes_dims_rope=(8, 12, 12)),
    "z-image": dict(ZIMAGE_CONFIG, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                    axes_dims=(8, 12, 12)),
    "flux2-klein": dict(FLUX2_KLEIN_CONFIG, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=32,
                        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(8, 8, 8, 8)),
    "qwen-image-2.1": dict(QWEN21_CONFIG, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32,
                           num_attention_heads=2, context_in_dim=32, axes_dims_rope=(8, 12, 12)),
    "hunyuan-image-2.1": dict(HUNYUAN21_CONFIG, in_channels=16, out_channels=16, num_attention_heads=2,
                              attention_head_dim=32, num_layers=1, num_single_layers=1, text_embed_dim=32,
                              text_embed_2_dim=16, rope_axes_dim=(16, 16)),
}
TEXT_TOKENS = {"flux": 512, "qwen-image": 128, "z-image": 128, "flux2-klein": 512, "qwen-image-2.1": 128,
               "hunyuan-image-2.1": 128}
SDPA_KERNELS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")


@dataclass
class Row:
    model: str
    size: int
    batch: int
    variant: str
    ms_median: float | None = None
    ms_min: float | None = None
    tflops: float | None = None
    pct_peak: float | None = None
    speedup_vs_diffusers: float | None = None
    speedup_vs_diffusers_compiled: float | None = None
    psnr_vs_diffusers: float | None = None
    psnr_vs_ours_eager: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """(median, min) ms over `iters` calls after `warmup` calls; CUDA events on GPU, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[0]


def count_tflop(fn: Callable[[], Any]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 1e12


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    med, _ = timed(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n**3 / (med / 1e3) / 1e12


KERNEL_CATEGORIES = (
    ("attention", ("attn", "fmha", "flash", "sdpa", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("triton", ("triton",)),
)


def kernel_breakdown(fn: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """GPU time of one call by kernel category (attention / GEMM / Triton / other) and its top kernels.

    Profiles the call without CUDA-graph replay (kernels inside a replayed graph are not reported one by one);
    at sizes where the forward is device-bound the kernel times are the same."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # Which host ops issue memsets (each one is a node of the replayed graph, i.e. one more gap).
    memset_sources: dict[str, int] = {}
    for event in prof.events():
        memsets = sum(kernel.name.startswith("Memset") for kernel in getattr(event, "kernels", ()))
        if memsets and not any(child.kernels for child in event.cpu_children):
            memset_sources[event.name] = memset_sources.get(event.name, 0) + memsets
    totals = {name: 0.0 for name, _ in KERNEL_CATEGORIES} | {"other": 0.0}
    kernels = []
    for event in prof.key_averages():
        us = event.device_time_total
        if us <= 0 or event.device_type != DeviceType.CUDA:  # host ops carry their kernels' time too
            continue
        key = event.key.lower()
        category = next((name for name, marks in KERNEL_CATEGORIES if any(m in key for m in marks)), "other")
        totals[category] += us / 1e3
        kernels.append({"ms": round(us / 1e3, 3), "calls": event.count, "category": category, "name": event.key[:100]})
    kernels.sort(key=lambda k: -k["ms"])
    return {"ms_by_category": {k: round(v, 2) for k, v in totals.items()},
            "gpu_ops": sum(k["calls"] for k in kernels), "memset_sources": memset_sources, "top_kernels": kernels[:top]}


def psnr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR over the reference's value range (dB); inf when identical."""
    got, ref = got.double(), ref.double()
    mse = torch.mean((got - ref) ** 2).item()
    peak = (ref.max() - ref.min()).item()
    if not math.isfinite(mse):
        return float("nan")
    return float("inf") if mse == 0 else 10 * math.log10(peak**2 / mse)


@contextlib.contextmanager
def vllm_single_rank(device: torch.device):
    """One-rank torch.distributed + vLLM groups with a current VllmConfig (what a diffusion worker sets up)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():  # e.g. inside a test session that already set one rank up
        with set_current_vllm_config(VllmConfig()):
            yield
        return
    vllm_config = init_diffusion_distributed(rank=0, world_size=1, parallel_config=DiffusionParallelConfig(),
                                             device=device)
    try:
        with set_current_vllm_config(vllm_config):
            yield
    finally:
        destroy_diffusion_distributed()


def set_attention_backend(model: torch.nn.Module, name: str) -> None:
    """Re-point every Attention layer of `model` at backend `name` (benchmark-only switch between runs)."""
    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.attention.selector import get_attn_backend

    backend = get_attn_backend(name)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.attn_backend = backend
            layer.impl = backend.get_impl_cls()(layer.num_heads, layer.head_dim, layer.num_kv_heads,
                                                layer.softmax_scale, layer.causal)


def _finish_load(model: torch.nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading

    loaded = model.load_weights(reference.state_dict().items())
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise RuntimeError(f"parameters not loaded from diffusers: {sorted(missing)[:5]}")
    process_weights_after_loading(model)
    return model.eval()


def build_models(name: str, config: dict, device: torch.device, dtype: torch.dtype):
    """(diffusers model, our model with the same weights); weights are diffusers' own random init."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), torch.device(device):
        if name == "flux":
            from diffusers import FluxTransformer2DModel as Reference

            from vllm_omni.models.flux.transformer import FluxTransformer2DModel

            reference = Reference(**config)
            ours = FluxTransformer2DModel(**config)
        elif name == "qwen-image":
            from diffusers import QwenImageTransformer2DModel as Reference

            from vllm_omni.models.qwen_image.transformer import (
                QwenImageTransformer2DModel,
                QwenImageTransformerConfig,
            )

            reference = Reference(**config)
            ours = QwenImageTransformer2DModel(config=QwenImageTransformerConfig.from_dict(config))
        elif name == "z-image":
            from diffusers import ZImageTransformer2DModel as Reference

            from vllm_omni.models.z_image.transformer import ZImageTransformer2DModel

            reference, ours = Reference(**config), ZImageTransformer2DModel.from_config(config)
        elif name == "flux2-klein":
            from diffusers import Flux2Transformer2DModel as Reference

            from vllm_omni.models.flux2.transformer import Flux2Transformer2DModel

            reference, ours = Reference(**config), Flux2Transformer2DModel.from_config(config)
        elif name == "hunyuan-image-2.1":
            from diffusers import HunyuanImageTransformer2DModel as Reference

            from vllm_omni.models.hunyuan_image_21.transformer import HunyuanImageTransformer2DModel

            reference, ours = Reference(**config), HunyuanImageTransformer2DModel.from_config(config)
        else:
            from diffusers import QwenImage21Transformer2DModel as Reference

            from vllm_omni.models.qwen_image_21.transformer import QwenImage21Transformer2DModel

            reference, ours = Reference(**config), QwenImage21Transformer2DModel.from_config(config)
    reference = reference.to(dtype).eval()
    return reference, _finish_load(ours, reference)


def make_inputs(name: str, config: dict, size: int, batch: int, text_tokens: int, device, dtype, ours):
    """(diffusers call, our call) on identical random inputs for one size."""
    g = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    t = torch.full((batch,), 0.5, device=device, dtype=dtype)
    if name == "flux":
        side = size // 16
        x = randn(batch, side * side, config["in_channels"])
        enc = randn(batch, text_tokens, config["joint_attention_dim"])
        pooled = randn(batch, config["pooled_projection_dim"])
        guidance = torch.full((batch,), 3.5, device=device, dtype=torch.float32)
        from vllm_omni.models.flux.pipeline import latent_image_ids

        img_ids = latent_image_ids(side, side).to(device, dtype)
        txt_ids = torch.zeros(text_tokens, 3, device=device, dtype=dtype)
        rope = ours.rotary_emb(txt_ids, img_ids)

        def ref_call(model):
            return model(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=t,
                         img_ids=img_ids, txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]

        def our_call(fn, step_table: bool = False):
            table = ours.step_slice(ours.step_modulation(t[None], guidance, pooled, dtype), 0) if step_table else None
            return fn(x, enc, pooled, t, guidance=guidance, rotary_emb=rope, modulation=table)
        return ref_call, our_call
    if name in NEW_FAMILY_INPUTS:
        return NEW_FAMILY_INPUTS[name](config, size, batch, text_tokens, t, randn, device, ours)
    side = size // 16
    x = randn(batch, side * side, config["in_channels"])
    enc = randn(batch, text_tokens, config["joint_attention_dim"])

    def ref_call(model):
        # Batch-1 prompts have no padding: diffusers' QwenImagePipeline then passes no mask, and so do we.
        return model(hidden_states=x, encoder_hidden_states=enc, encoder_hidden_states_mask=None, timestep=t,
                     img_shapes=[[(1, side, side)]] * batch, return_dict=False)[0]

    def our_call(fn, step_table: bool = False):
        # step_table: the denoise loop's way, adaLN parameters from the request's per-step table
        # (`step_modulation`, computed once per request for all steps, outside the timed forward).
        table = ours.step_modulation(t[:1], dtype) if step_table else None
        return fn(x, enc, None, t, [(1, side, side)], table)
    return ref_call, our_call


def z_image_inputs(config, size, batch, text_tokens, t, randn, device, ours):
    side = size // 8  # VAE 8x; the DiT folds 2 x 2 latents into a token
    latents = randn(batch, config["in_channels"], side, side)
    caps = randn(batch, text_tokens, config["cap_feat_dim"])

    def ref_call(model):
        out = model(list(latents[:, :, None]), t, list(caps), return_dict=False)[0]
        return torch.stack(out)[:, :, 0]

    def our_call(fn):
        return fn(latents, t, caps, (text_tokens,) * batch)
    return ref_call, our_call


def flux2_inputs(config, size, batch, text_tokens, t, randn, device, ours):
    side = size // 16
    n = side * side
    x = randn(batch, n, config["in_channels"])
    enc = randn(batch, text_tokens, config["joint_attention_dim"])
    zeros = torch.zeros(n, device=device)
    grid = torch.arange(n, device=device)
    img_ids = torch.stack([zeros, grid // side, grid % side, zeros], dim=1)
    txt_ids = torch.zeros(text_tokens, 4, device=device)
    txt_ids[:, 3] = torch.arange(text_tokens, device=device)

    def ref_call(model):
        return model(hidden_states=x, encoder_hidden_states=enc, timestep=t, img_ids=img_ids[None],
                     txt_ids=txt_ids[None], return_dict=False)[0]

    def our_call(fn):
        return fn(x, enc, t, img_ids=img_ids, txt_ids=txt_ids)
    return ref_call, our_call


def qwen_image_21_inputs(config, size, batch, text_tokens, t, randn, device, ours):
    """A steady step: the text K/V of both models computed once, outside the timed calls (ours here; diffusers'
    "extract" step at its first call, which `run_model` makes before counting FLOPs)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    side = size // 16
    x = randn(batch, side * side, config["in_channels"])
    text = randn(1, text_tokens, config["context_in_dim"]).expand(batch, -1, -1)
    img_mask = torch.cat([torch.zeros(batch, text_tokens, dtype=torch.bool, device=device),
                          torch.ones(batch, side * side // 4, dtype=torch.bool, device=device)], dim=1)
    cache = QwenImage21KVCache(config["num_layers"])
    prefix_kv, frame = ours.prefix_kv(text[:1])
    prefix_kv = prefix_kv.expand(batch, *prefix_kv.shape[1:])

    def ref_call(model):
        mode = "extract" if cache.get_layer(0).k is None else "cached"
        return model(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, side, side)]] * batch,
                     img_mask=img_mask, kv_cache=cache, kv_cache_mode=mode, return_dict=False)[0][:, -side * side:]

    def our_call(fn):
        return fn(x, t, prefix_kv, (text_tokens,) * batch, (frame,) * batch, (side, side))
    return ref_call, our_call


def hunyuan_image_21_inputs(config, size, batch, text_tokens, t, randn, device, ours):
    """Each model's forward as its pipeline calls it: diffusers' prompt padded to 1000 Qwen2.5-VL + 128 ByT5
    tokens under a key mask (`HunyuanImagePipeline`; no quoted text, so no ByT5 token is real), ours over the
    `text_tokens` real ones."""
    side = size // 32  # VAE 32x, 1 x 1 patches
    latents = randn(batch, config["in_channels"], side, side)
    text = randn(batch, text_tokens, config["text_embed_dim"])
    padded = torch.cat([text, text.new_zeros(batch, 1000 - text_tokens, text.shape[2])], dim=1)
    mask = (torch.arange(1000, device=device) < text_tokens).long().expand(batch, -1)
    glyph = torch.zeros(batch, 128, config["text_embed_2_dim"], device=device, dtype=text.dtype)
    glyph_mask = torch.zeros(batch, 128, device=device, dtype=torch.long)
    timestep = t * 1000

    def ref_call(model):
        return model(latents, timestep, padded, mask, encoder_hidden_states_2=glyph,
                     encoder_attention_mask_2=glyph_mask, return_dict=False)[0]

    def our_call(fn):
        return fn(latents, timestep, text, (text_tokens,) * batch, glyph[:, :0], (0,) * batch)
    return ref_call, our_call


NEW_FAMILY_INPUTS = {"z-image": z_image_inputs, "flux2-klein": flux2_inputs, "qwen-image-2.1": qwen_image_21_inputs,
                     "hunyuan-image-2.1": hunyuan_image_21_inputs}


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, peak: float):
        self.args, self.device, self.dtype, self.peak = args, device, dtype, peak
        self.rows: list[Row] = []

    def measure(self, row: Row, fn: Callable[[], torch.Tensor], tflop: float, ref_ms: float | None,
                ref_out: torch.Tensor | None, eager_out: torch.Tensor | None) -> torch.Tensor | None:
        try:
            out = fn()
            sync(self.device)
            row.ms_median, row.ms_min = timed(fn, self.device, self.args.warmup, self.args.iters)
        except Exception as exc:  # a variant that cannot run here is reported, the others go on
            row.note = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(asdict(row)), flush=True)
            self.rows.append(row)
            return None
        row.tflops = tflop / (row.ms_median / 1e3)
        row.pct_peak = 100 * row.tflops / self.peak
        if ref_ms:
            row.speedup_vs_diffusers = ref_ms / row.ms_median
        if ref_out is not None:
            row.psnr_vs_diffusers = psnr(out, ref_out)
        if eager_out is not None:
            row.psnr_vs_ours_eager = psnr(out, eager_out)
        print(json.dumps(asdict(row)), flush=True)
        self.rows.append(row)
        return out

    def run_model(self, name: str) -> None:
        args, device, dtype = self.args, self.device, self.dtype
        config = SMOKE[name] if args.smoke else CONFIGS[name]
        t0 = time.perf_counter()
        reference, ours = build_models(name, config, device, dtype)
        print(json.dumps({"model": name, "build_s": round(time.perf_counter() - t0, 1),
                          "params_b": round(sum(p.numel() for p in reference.parameters()) / 1e9, 2)}), flush=True)
        text_tokens = args.text_tokens or (16 if args.smoke else TEXT_TOKENS[name])
        plans = [(size, batch) for size in args.sizes for batch in args.batches]
        eager_outs: dict[tuple[int, int], torch.Tensor] = {}
        ref_info: dict[tuple[int, int], tuple[float, float, torch.Tensor]] = {}
        with torch.inference_mode():
            for size, batch in plans:
                ref_call, our_call = make_inputs(name, config, size, batch, text_tokens, device, dtype, ours)
                ref_fn, our_fn = functools.partial(ref_call, reference), functools.partial(our_call, ours)
                ref_fn()  # a first call outside the FLOP count (Qwen-Image-2.1: diffusers' extract step)
                tflop = count_tflop(ref_fn)
                row = Row(name, size, batch, "diffusers eager", extra={"tflop": round(tflop, 2)})
                ref_out = self.measure(row, ref_fn, tflop, None, None, None)
                ref_info[(size, batch)] = (row.ms_median, tflop, ref_out)
                ref_ms = row.ms_median
                row = Row(name, size, batch, "ours eager (TORCH_SDPA)")
                eager = self.measure(row, our_fn, tflop, ref_ms, ref_out, None)
                eager_outs[(size, batch)] = eager
                if device.type == "cuda" and args.eager_variants:
                    self._attention_variants(name, size, batch, ours, our_call, tflop, ref_ms, ref_out, eager)
                    self._graph_variant(name, size, batch, "ours eager + CUDA graph", ours, our_call, tflop,
                                        ref_ms, ref_out, eager)
            compiled_ms = self._diffusers_compiled(name, reference, plans, config, text_tokens, ours, ref_info) \
                if args.diffusers_compiled and device.type == "cuda" else {}
            if args.compile:
                self._compiled_variants(name, ours, plans, config, text_tokens, ref_info, eager_outs)
        for row in self.rows:  # every row of ours, against the second reference too
            if row.model == name and compiled_ms.get((row.size, row.batch)) and row.ms_median \
                    and not row.variant.startswith("diffusers"):
                row.speedup_vs_diffusers_compiled = compiled_ms[(row.size, row.batch)] / row.ms_median

    def _diffusers_compiled(self, name, reference, plans, config, text_tokens, ours, ref_info
                            ) -> dict[tuple[int, int], float]:
        """diffusers' transformer with `compile_repeated_blocks` (in place: after every eager diffusers row), per
        plan: its median ms."""
        reference.compile_repeated_blocks(fullgraph=True, mode=self.args.compile_mode)
        out: dict[tuple[int, int], float] = {}
        for size, batch in plans:
            ref_ms, tflop, ref_out = ref_info[(size, batch)]
            ref_call, _ = make_inputs(name, config, size, batch, text_tokens, self.device, self.dtype, ours)
            t0 = time.perf_counter()
            row = Row(name, size, batch, "diffusers compile_repeated_blocks")
            if self.measure(row, functools.partial(ref_call, reference), tflop, ref_ms, ref_out, None) is not None:
                out[(size, batch)] = row.ms_median
            row.extra["first_call_s"] = round(time.perf_counter() - t0, 1)
        return out

    def _attention_variants(self, name, size, batch, ours, our_call, tflop, ref_ms, ref_out, eager) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for kernel in SDPA_KERNELS:
            row = Row(name, size, batch, f"ours eager (SDPA {kernel})")

            def fn(kernel=kernel):
                with sdpa_kernel([getattr(SDPBackend, kernel)]):
                    return our_call(ours)
            self.measure(row, fn, tflop, ref_ms, ref_out, eager)

    def _graph_variant(self, name, size, batch, label, ours, our_call, tflop, ref_ms, ref_out, eager) -> None:
        from vllm_omni.diffusion.layers.cuda_graph import CUDAGraphRunner

        runner = CUDAGraphRunner(ours.forward)
        row = Row(name, size, batch, label)
        self.measure(row, lambda: our_call(runner), tflop, ref_ms, ref_out, eager)
        runner.reset()
        torch.cuda.empty_cache()

    def _compiled_variants(self, name, ours, plans, config, text_tokens, ref_info, eager_outs) -> None:
        from vllm_omni.diffusion.layers.compile import compile_repeated_blocks

        compile_repeated_blocks(ours, mode=self.args.compile_mode)
        backends = self.args.attention_backends if self.device.type == "cuda" else ["TORCH_SDPA"]
        for backend in backends:
            set_attention_backend(ours, backend)
            for size, batch in plans:
                ref_ms, tflop, ref_out = ref_info[(size, batch)]
                _, our_call = make_inputs(name, config, size, batch, text_tokens, self.device, self.dtype, ours)
                t0 = time.perf_counter()
                row = Row(name, size, batch, f"ours compiled ({backend})")
                out = self.measure(row, functools.partial(our_call, ours), tflop, ref_ms, ref_out,
                                   eager_outs[(size, batch)])
                row.extra["first_call_s"] = round(time.perf_counter() - t0, 1)
                if self.args.profile and self.device.type == "cuda" and out is not None:
                    row.extra["profile"] = kernel_breakdown(functools.partial(our_call, ours))
                    print(json.dumps({"profile": row.variant, "size": size, **row.extra["profile"]}), flush=True)
                if self.device.type == "cuda" and out is not None:
                    self._graph_variant(name, size, batch, f"ours compiled ({backend}) + CUDA graph", ours, our_call,
                                        tflop, ref_ms, ref_out, eager_outs[(size, batch)])
                    if name in STEP_TABLE_MODELS:
                        self._step_table_variant(name, size, batch, backend, ours, our_call, tflop, ref_ms, ref_out,
                                                 eager_outs[(size, batch)])
        set_attention_backend(ours, "TORCH_SDPA")


    def _step_table_variant(self, name, size, batch, backend, ours, our_call, tflop, ref_ms, ref_out, eager) -> None:
        """The forward as the denoise loop runs it: graph replay with this step's slice of the adaLN table."""
        from vllm_omni.diffusion.layers.cuda_graph import CUDAGraphRunner

        runner = CUDAGraphRunner(ours.forward)
        row = Row(name, size, batch, f"ours compiled ({backend}) + CUDA graph + step table")
        with torch.inference_mode():
            table_ms, _ = timed(lambda: our_call(lambda *a, **k: None, step_table=True), self.device, 1, 3)
            args, kwargs = our_call(lambda *a, **k: (a, k), step_table=True)  # this step's table, computed once
        row.extra["table_ms_once_per_request"] = round(table_ms, 2)
        self.measure(row, lambda: runner(*args, **kwargs), tflop, ref_ms, ref_out, eager)
        runner.reset()
        torch.cuda.empty_cache()


def print_table(rows: list[Row]) -> None:
    def fmt(value, spec):
        return format("-", f">{spec.split('.')[0]}") if value is None else format(value, spec)

    header = f"{'model':<15}{'size':>6}{'bs':>4}  {'variant':<36}{'ms':>9}{'TFLOP/s':>9}{'%peak':>7}{'x diff':>8}"
    print("\n" + header + f"{'x comp':>8}{'PSNR/diff':>11}{'PSNR/eager':>11}")
    for r in rows:
        print(f"{r.model:<15}{r.size:>6}{r.batch:>4}  {r.variant:<36}{fmt(r.ms_median, '9.2f')}"
              f"{fmt(r.tflops, '9.1f')}{fmt(r.pct_peak, '7.1f')}{fmt(r.speedup_vs_diffusers, '8.2f')}"
              f"{fmt(r.speedup_vs_diffusers_compiled, '8.2f')}{fmt(r.psnr_vs_diffusers, '11.1f')}"
              f"{fmt(r.psnr_vs_ours_eager, '11.1f')}  {r.note[:60]}")


def environment(device: torch.device) -> dict[str, Any]:
    import diffusers

    env = {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        for module in ("triton", "flash_attn", "flashinfer"):
            try:
                env[module] = __import__(module).__version__
            except Exception:  # noqa: BLE001 - absent optional kernel packages are recorded as such
                env[module] = None
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["flux", "qwen-image"], choices=list(CONFIGS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 512], help="square image side in pixels")
    parser.add_argument("--text-tokens", type=int, default=None,
                        help="prompt tokens per sample (default: TEXT_TOKENS, e.g. 512 FLUX, 128 Qwen-Image)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time regional torch.compile (+ CUDA graph) variants")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode for the blocks")
    parser.add_argument("--eager-variants", action=argparse.BooleanOptionalAction, default=True,
                        help="also time eager SDPA kernels and eager + CUDA graph (CUDA)")
    parser.add_argument("--attention-backends", nargs="+", default=["CUDNN_ATTN", "TORCH_SDPA"],
                        help="our attention backends to time the compiled variants with (CUDA)")
    parser.add_argument("--diffusers-compiled", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: also time diffusers with compile_repeated_blocks (the second reference)")
    parser.add_argument("--profile", action="store_true",
                        help="also record a per-kernel-category GPU time breakdown of each compiled variant (CUDA)")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (fp32), seconds")
    parser.add_argument("--out", type=Path, default=None, help="JSON results path")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.warmup, args.iters = [64], 1, 2
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    # One compiled graph per block class and shape; every layer instance must reuse it, not hit the limit.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    env = environment(device)
    peak = matmul_peak_tflops(device, dtype)
    env["matmul_peak_tflops"] = round(peak, 1)
    print(json.dumps(env), flush=True)
    bench = Bench(args, device, dtype, peak)
    with vllm_single_rank(device):
        for name in args.models:
            try:
                bench.run_model(name)
            except Exception as exc:  # keep the other model's numbers
                import traceback

                traceback.print_exc()
                bench.rows.append(Row(name, 0, 0, "build", note=f"failed: {type(exc).__name__}: {exc}"[:300]))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:
                _write(args, env, bench.rows)
    print_table(bench.rows)
    result = _write(args, env, bench.rows)
    return result


def _write(args: argparse.Namespace, env: dict, rows: list[Row]) -> dict[str, Any]:
    result = {"command": " ".join(sys.argv), "env": env, "rows": [asdict(r) for r in rows]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
