"""Wan text-to-video: our native DiT / pipeline vs diffusers', same process, same random weights.

GPU (default): the real Wan2.1-T2V-1.3B transformer config (30 layers, 12 x 128 heads) with random bf16 weights,
diffusers' `WanTransformer3DModel` copied into ours through our name-mapping loader. Times
  - one CFG step of the DiT: diffusers runs the positive and negative forwards one after the other (as its
    pipeline does), ours runs them as one batch of 2;
  - the whole pipeline (text encoder, denoise, VAE decode) with shared UMT5 / VAE / scheduler config, reporting
    per-stage seconds and the PSNR of our frames against diffusers' (bf16, so not bit-equal).
`--smoke` runs the tiny checkpoint on the CPU in fp32. Prints a table and writes JSON (`--out`).

  python benchmarks/diffusion/bench_wan.py --frames 33 81 --steps 10 --out benchmarks/results/bench_wan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit_forward import environment, sync, timed, vllm_single_rank  # noqa: E402

WAN21_13B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                 out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
PROMPT = "A cat walks on the grass, camera slowly pans left."


def frames_psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def build_transformers(config: dict, device: torch.device, dtype: torch.dtype):
    from diffusers import WanTransformer3DModel as Reference
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_omni.diffusion.model_loader.components import keep_in_fp32_modules
    from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading
    from vllm_omni.models.wan.transformer import WanTransformer3DModel, WanTransformerConfig

    torch.manual_seed(0)
    with torch.device(device):
        reference = Reference(**config).to(dtype).eval()
    for name, param in reference.named_parameters():  # as diffusers' from_pretrained keeps them
        if set(name.split(".")) & set(Reference._keep_in_fp32_modules):
            param.data = param.data.float()
    with set_default_torch_dtype(dtype), torch.device(device):
        ours = WanTransformer3DModel(WanTransformerConfig(**config))
    ours.load_weights(reference.state_dict().items())
    process_weights_after_loading(ours)
    keep_in_fp32_modules(ours)
    return reference, ours.to(device).eval()


def dit_step_fns(reference, ours, frames: int, height: int, width: int, text_tokens: int, device, dtype):
    """(diffusers CFG step, ours(fn) CFG step, tokens) on fixed random inputs; diffusers runs positive and negative
    one after the other (as its pipeline does), ours as one batch of 2 through `fn`."""
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, generator=g).to(device, dtype)
    pos = torch.randn(1, text_tokens, 4096 if reference.config.text_dim == 4096 else reference.config.text_dim,
                      generator=g).to(device, dtype)
    neg = torch.randn_like(pos)
    t = torch.tensor([500.0], device=device)

    def diffusers_step():
        with torch.no_grad():
            a = reference(latent, t, pos, return_dict=False)[0]
            b = reference(latent, t, neg, return_dict=False)[0]
        return b + 5.0 * (a - b)

    def ours_step(fn=ours):
        with torch.no_grad():
            out = fn(torch.cat([latent, latent]), t.expand(2), torch.cat([pos, neg]))
        return out[1:] + 5.0 * (out[:1] - out[1:])

    return diffusers_step, ours_step, latent.shape[2] * latent.shape[3] * latent.shape[4] // 4


def bench_dit_step(reference, ours, frames: int, height: int, width: int, text_tokens: int, device, dtype,
                   warmup: int, iters: int) -> tuple[dict[str, Any], torch.Tensor]:
    diffusers_step, ours_step, tokens = dit_step_fns(reference, ours, frames, height, width, text_tokens, device,
                                                     dtype)
    ref_ms, _ = timed(diffusers_step, device, warmup, iters)
    our_ms, _ = timed(ours_step, device, warmup, iters)
    eager = ours_step().float()
    diff = (eager - diffusers_step().float()).abs().max().item()
    return {"what": "DiT CFG step", "frames": frames, "size": f"{width}x{height}", "tokens": tokens,
            "diffusers_ms": ref_ms, "ours_ms": our_ms, "speedup": ref_ms / our_ms, "max_abs_diff": diff}, eager


def bench_dit_step_compiled(row: dict[str, Any], eager: torch.Tensor, reference, ours, height: int, width: int,
                            text_tokens: int, device, dtype, warmup: int, iters: int) -> None:
    """Adds ours with compiled blocks (compile them first), and replayed as a CUDA graph, to an eager `row`."""
    from vllm_omni.diffusion.layers.cuda_graph import CUDAGraphRunner

    _, ours_step, _ = dit_step_fns(reference, ours, row["frames"], height, width, text_tokens, device, dtype)
    variants = [("compiled", ours)]
    if device.type == "cuda":
        variants.append(("compiled_graph", CUDAGraphRunner(ours.forward)))
    for label, fn in variants:
        row[f"ours_{label}_ms"], _ = timed(lambda fn=fn: ours_step(fn), device, warmup, iters)
        row[f"speedup_{label}"] = row["diffusers_ms"] / row[f"ours_{label}_ms"]
        row[f"{label}_max_abs_diff_vs_eager"] = (ours_step(fn).float() - eager).abs().max().item()


def build_pipelines(args, device, dtype, reference, ours):
    """Diffusers' WanPipeline and ours on the same text encoder, VAE, scheduler config and DiT weights."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from diffusers import WanPipeline as RefPipeline
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.models.wan.pipeline import WanPipeline

    tiny = build_tiny("wan2.1-t2v")
    tokenizer = AutoTokenizer.from_pretrained(tiny / "tokenizer")
    scheduler_config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    if args.smoke:
        text_encoder = UMT5EncoderModel.from_pretrained(tiny / "text_encoder").to(device, dtype).eval()
        vae = AutoencoderKLWan.from_pretrained(tiny / "vae").to(device).eval()
    else:  # the real umt5-xxl encoder and Wan VAE shapes, random weights
        torch.manual_seed(2)
        with torch.device(device):
            text_encoder = UMT5EncoderModel(UMT5Config(
                vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False)).to(dtype).eval()
            vae = AutoencoderKLWan().eval()
    ref = RefPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=reference,
                      scheduler=UniPCMultistepScheduler.from_config(scheduler_config))
    ref.set_progress_bar_config(disable=True)
    our = WanPipeline(od_config=OmniDiffusionConfig(model="bench"), device=device, dtype=dtype, tokenizer=tokenizer,
                      text_encoder=text_encoder, transformer=ours, transformer_2=None, vae=vae,
                      scheduler_config=scheduler_config, boundary_ratio=None)
    return ref, our


def bench_pipeline(ref, our, frames: int, height: int, width: int, steps: int, device) -> dict[str, Any]:
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    kwargs = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=5.0)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        expected = ref(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="np",
                       **kwargs).frames[0]
    sync(device)
    ref_s = time.perf_counter() - t0
    request = OmniDiffusionRequest(PROMPT, OmniDiffusionSamplingParams(seed=0, **kwargs), "bench")
    t0 = time.perf_counter()
    (out,) = our.forward(DiffusionRequestBatch([request]))
    sync(device)
    our_s = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(out.error)
    video = out.output["video"]
    return {"what": "pipeline", "frames": frames, "size": f"{width}x{height}", "steps": steps,
            "diffusers_s": ref_s, "ours_s": our_s, "speedup": ref_s / our_s,
            "psnr_vs_diffusers": frames_psnr(video, (expected * 255).round()), "stages": out.stage_durations}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", nargs="+", type=int, default=[33, 81])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-pipeline", action="store_true", help="only the DiT step")
    parser.add_argument("--compile", action="store_true",
                        help="DiT step also with compiled blocks and as a CUDA graph (the pipeline stays eager)")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU (fp32)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.smoke:
        args.frames, args.height, args.width, args.steps, args.warmup, args.iters = [9], 32, 48, 2, 1, 2
    env = environment(device)
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    with vllm_single_rank(device):
        if args.smoke:
            from vllm_omni.catalog.tiny import build_tiny

            config = json.loads((build_tiny("wan2.1-t2v") / "transformer" / "config.json").read_text())
            config = {k: v for k, v in config.items() if not k.startswith("_")}
        else:
            config = WAN21_13B
        reference, ours = build_transformers(config, device, dtype)
        eager_outs = []
        for frames in args.frames:
            row, eager = bench_dit_step(reference, ours, frames, args.height, args.width, 512, device, dtype,
                                        args.warmup, args.iters)
            rows.append(row)
            eager_outs.append(eager)
            print(json.dumps(row), flush=True)
        if args.compile:
            from vllm_omni.diffusion.layers.compile import compile_repeated_blocks

            compile_repeated_blocks(ours)
            for row, eager in zip(rows, eager_outs, strict=True):
                bench_dit_step_compiled(row, eager, reference, ours, args.height, args.width, 512, device, dtype,
                                        args.warmup, args.iters)
                print(json.dumps(row), flush=True)
        if not args.no_pipeline:
            ref, our = build_pipelines(args, device, dtype, reference, ours)
            for frames in args.frames:
                bench_pipeline(ref, our, frames, args.height, args.width, 1, device)  # warm-up (kernels, caches)
                rows.append(bench_pipeline(ref, our, frames, args.height, args.width, args.steps, device))
                print(json.dumps(rows[-1], default=str), flush=True)
    print(f"\n{'what':<14}{'frames':>7}{'size':>9}{'diffusers':>12}{'ours':>10}{'x':>7}  extra")
    for r in rows:
        unit = "ms" if "ours_ms" in r else "s"
        ref_v, our_v = (r["diffusers_ms"], r["ours_ms"]) if unit == "ms" else (r["diffusers_s"], r["ours_s"])
        stages = json.dumps({k: round(v, 2) for k, v in r.get("stages", {}).items()})
        extra = (f"max|diff| {r['max_abs_diff']:.3g}" if unit == "ms" else
                 f"PSNR {r['psnr_vs_diffusers']:.1f} dB, stages {stages}")
        if "ours_compiled_ms" in r:
            extra += f"; compiled {r['ours_compiled_ms']:.1f} ms ({r['speedup_compiled']:.2f}x)"
        if "ours_compiled_graph_ms" in r:
            extra += f", + CUDA graph {r['ours_compiled_graph_ms']:.1f} ms ({r['speedup_compiled_graph']:.2f}x)"
        print(f"{r['what']:<14}{r['frames']:>7}{r['size']:>9}{ref_v:>10.1f}{unit:<2}{our_v:>8.1f}{unit:<2}"
              f"{r['speedup']:>7.2f}  {extra}")
    result = {"command": " ".join(sys.argv), "env": env, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
