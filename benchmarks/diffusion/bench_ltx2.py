"""LTX-2 text-to-video with audio: our native pipeline vs diffusers' `LTX2Pipeline`, same process, same weights.

GPU (default): a config-only checkpoint with the real LTX-2 component sizes (the 48-layer audio-video DiT,
Gemma3-12B, the video and audio VAEs, the vocoder; diffusers' defaults for the LTX-2 classes, Gemma3-12B's
published config), built by our loader with `load_format="dummy"` (random bf16 weights); diffusers' pipeline
runs on the very same modules (its `LTX2VideoTransformer3DModel` shares our native DiT's parameter tensors). Times
  - one CFG denoise step (prediction + guidance + Euler step; both run positive and negative rows in one DiT
    forward, as diffusers' pipeline does),
  - the whole pipeline (text encoder, denoise, video + audio decode),
  - with `--two-stage`, the two-stage variant too (`two_stage=True` at --height x --width vs diffusers' recipe:
    `LTX2Pipeline` to latents at half size, `LTX2LatentUpsamplePipeline`, `LTX2Pipeline` refine on the stage-2
    distilled sigmas), on the same upsampler module; both refine without the distilled LoRA (the config-only
    checkpoint has none, and ours runs with LoRA off, as the rows above),
eager and, with `--compile`, with the DiT's repeated blocks compiled on both sides (`torch.compile`).
`--smoke` runs the tiny checkpoint on the CPU in fp32 (tests/benchmarks/test_bench_ltx2.py). Prints a table and
writes JSON (`--out`) and a PNG bar chart (`--png`).

  python benchmarks/diffusion/bench_ltx2.py --frames 121 --steps 10 --compile \\
      --out benchmarks/results/bench_ltx2.json --png benchmarks/results/bench_ltx2.png
  python benchmarks/diffusion/bench_ltx2.py --two-stage --height 1024 --width 1536 --frames 121 --steps 10 \\
      --out benchmarks/results/bench_ltx2_two_stage.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit_forward import environment, sync, timed, vllm_single_rank  # noqa: E402

PROMPT = "A man plays a red electric guitar on a stage, the crowd cheers."
# Gemma3-12B (google/gemma-3-12b-it), LTX-2's text encoder; vision tower of Gemma3 (SigLIP so400m).
GEMMA3_12B_TEXT = dict(
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=262208,
    sliding_window=1024,
    max_position_embeddings=131072,
    rope_scaling={"factor": 8.0, "rope_type": "linear"},
)
GEMMA3_VISION = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=896,
    patch_size=14,
)
CFG_ONLY = dict(
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_rescale=0.0,
)
"""diffusers' knobs for the guidance our pipeline runs (classifier-free guidance on both modalities)."""


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def snr(signal: np.ndarray, reference: np.ndarray) -> float:
    noise = float(np.sum((signal.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / noise)


def write_real_size_checkpoint(out: Path) -> Path:
    """The tiny checkpoint's layout (tokenizer, scheduler, model_index) with real-size component configs and no
    weights."""
    from vllm_omni.catalog.tiny import build_tiny

    tiny = build_tiny("ltx2")
    for name in ("model_index.json",):
        shutil.copy(tiny / name, out / name)
    for folder in ("tokenizer", "scheduler"):
        shutil.copytree(tiny / folder, out / folder)
    configs: dict[str, dict[str, Any]] = {
        "transformer": {"_class_name": "LTX2VideoTransformer3DModel"},
        "connectors": {"_class_name": "LTX2TextConnectors"},
        "vae": {"_class_name": "AutoencoderKLLTX2Video"},
        "audio_vae": {"_class_name": "AutoencoderKLLTX2Audio"},
        "vocoder": {"_class_name": "LTX2Vocoder"},
        "latent_upsampler": {"_class_name": "LTX2LatentUpsamplerModel"},  # diffusers' defaults: LTX-2.0's x2
    }
    tiny_text = json.loads((tiny / "text_encoder" / "config.json").read_text())
    tiny_text["text_config"].pop("layer_types", None)  # derived from num_hidden_layers once the tiny list is gone
    text = {
        **tiny_text,
        "text_config": {**tiny_text["text_config"], **GEMMA3_12B_TEXT},
        "vision_config": {**tiny_text["vision_config"], **GEMMA3_VISION},
        "mm_tokens_per_image": 256,
    }
    configs["text_encoder"] = text
    for folder, config in configs.items():
        (out / folder).mkdir()
        (out / folder / "config.json").write_text(json.dumps(config, indent=1))
    return out


def load(model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype):
    """(ours, diffusers') on one set of modules; diffusers' `LTX2VideoTransformer3DModel` has our native DiT's
    weights (the parameter names are the same). Both start eager."""
    from dataclasses import asdict

    from diffusers import LTX2Pipeline as RefPipeline
    from diffusers import LTX2VideoTransformer3DModel

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.models.ltx2.pipeline import LTX2Pipeline

    od_config = OmniDiffusionConfig(model=str(model_dir), load_format=load_format, enforce_eager=True)
    ours = LTX2Pipeline.from_pretrained(od_config, model_dir, device, dtype)
    if load_format == "dummy":  # the random weights exist only in our modules: share their tensors
        with torch.device("meta"):
            dit = LTX2VideoTransformer3DModel.from_config(asdict(ours.transformer.config))
        dit.load_state_dict(ours.transformer.state_dict(), assign=True, strict=True)
    else:  # a checkpoint (the CPU smoke run, where vLLM repacks our linears' weights for oneDNN): load it again
        dit = LTX2VideoTransformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=dtype).to(device)
    dit.eval()
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref = RefPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(ours.scheduler_config),
        vae=ours.vae,
        audio_vae=ours.audio_vae,
        text_encoder=ours.text_encoder,
        tokenizer=ours.tokenizer,
        connectors=ours.connectors,
        transformer=dit,
        vocoder=ours.vocoder,
    )
    ref.set_progress_bar_config(disable=True)
    return ours, ref


def request(kwargs: dict[str, Any]):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionRequest(PROMPT, OmniDiffusionSamplingParams(seed=0, **kwargs), "bench")


def bench_step(ours, ref, kwargs: dict[str, Any], device, warmup: int, iters: int) -> dict[str, Any]:
    """One CFG step at step 0 (state reset each call): ours `denoise_step`; diffusers the same DiT forward over
    its [negative, positive] rows, x0-space guidance and Euler step its `__call__` runs."""
    from vllm_omni.diffusion.step_context import StepContext

    rq = request(kwargs)
    ctx = StepContext(ours.od_config, request_ids=[rq.request_id])
    with torch.no_grad():
        state = ours.prepare([rq], ctx)
    latents = state.latents.clone()

    def ours_step():
        state.latents, state.step_index = latents, 0
        state.scheduler = ours.make_scheduler([rq], latents)  # a fresh one: diffusers' keeps its step index
        with torch.no_grad():
            ours.denoise_step(state, ctx)

    g, cond = state.conditioning.geometry, state.conditioning
    video, audio = ours.unpack(latents, g)
    video = video.flatten(2).transpose(1, 2)
    neg_pos = [
        torch.cat([cond.video_embeds[1:], cond.video_embeds[:1]]),
        torch.cat([cond.audio_embeds[1:], cond.audio_embeds[:1]]),
        torch.cat([cond.text_mask[1:], cond.text_mask[:1]]),
    ]
    scheduler = ours.make_scheduler([rq], latents)
    t = scheduler.timesteps[0]
    guidance = cond.cfg.scale

    def diffusers_step():
        with torch.no_grad():
            v, a = ref.transformer(
                hidden_states=torch.cat([video, video]).to(ours.dtype),
                audio_hidden_states=torch.cat([audio, audio]).to(ours.dtype),
                encoder_hidden_states=neg_pos[0],
                audio_encoder_hidden_states=neg_pos[1],
                timestep=t.expand(2),
                sigma=t.expand(2),
                encoder_attention_mask=neg_pos[2],
                audio_encoder_attention_mask=neg_pos[2],
                num_frames=g.latent_frames,
                height=g.latent_height,
                width=g.latent_width,
                fps=float(g.fps),
                audio_num_frames=g.audio_frames,
                use_cross_timestep=True,
                return_dict=False,
            )
            sigma = scheduler.sigmas[0]
            out = []
            for pred, x in ((v.float(), video), (a.float(), audio)):
                x0_u, x0_c = x - pred[:1] * sigma, x - pred[1:] * sigma
                x0 = x0_c + (guidance - 1) * (x0_c - x0_u)
                out.append(x + (scheduler.sigmas[1] - sigma) * (x - x0) / sigma)
        return out

    ref_ms, _ = timed(diffusers_step, device, warmup, iters)
    our_ms, _ = timed(ours_step, device, warmup, iters)
    return {"what": "CFG step", "diffusers_ms": ref_ms, "ours_ms": our_ms, "ratio": our_ms / ref_ms}


def bench_pipeline(ours, ref, kwargs: dict[str, Any], device) -> dict[str, Any]:
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        expected = ref(
            prompt=PROMPT,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="np",
            guidance_scale=kwargs["guidance_scale"],
            audio_guidance_scale=kwargs["guidance_scale"],
            frame_rate=float(kwargs["fps"]),
            **{k: v for k, v in kwargs.items() if k not in ("guidance_scale", "fps")},
            **CFG_ONLY,
        )
    sync(device)
    ref_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (out,) = ours.forward(DiffusionRequestBatch([request(kwargs)]))
    sync(device)
    our_s = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(out.error)
    frames = (expected.frames[0] * 255).round()
    return {
        "what": "pipeline",
        "diffusers_s": ref_s,
        "ours_s": our_s,
        "ratio": our_s / ref_s,
        "psnr_vs_diffusers": psnr(out.output["video"], frames),
        "audio_snr_vs_diffusers": snr(out.output["audio"], expected.audio[0].float().cpu().numpy()),
        "stages": out.stage_durations,
    }


def diffusers_two_stage(
    ref, upsampler, kwargs: dict[str, Any], prompt: str, seed: int, distilled_lora: Path | None = None
) -> Any:
    """diffusers' "Two-stages Generation" recipe (its LTX-2 docs) at kwargs' (full) size, CFG-only: `ref` to
    latents at half size, `LTX2LatentUpsamplePipeline` with `upsampler`, `ref` again on
    `STAGE_2_DISTILLED_SIGMA_VALUES` (no dynamic shift, re-noised to the first sigma, no guidance) with the
    `distilled_lora` file loaded as the docs do (`load_lora_weights(..., adapter_name="stage_2_distilled")`,
    `set_adapters("stage_2_distilled", 1.0)`; deleted afterwards); one generator for the run. Returns the second
    call's output (frames in [0, 1], audio)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    common = dict(
        prompt=prompt,
        generator=torch.Generator("cpu").manual_seed(seed),
        frame_rate=float(kwargs["fps"]),
        num_frames=kwargs["num_frames"],
        max_sequence_length=kwargs["max_sequence_length"],
        **CFG_ONLY,
    )
    video, audio = ref(
        height=kwargs["height"] // 2,
        width=kwargs["width"] // 2,
        num_inference_steps=kwargs["num_inference_steps"],
        guidance_scale=kwargs["guidance_scale"],
        audio_guidance_scale=kwargs["guidance_scale"],
        output_type="latent",
        return_dict=False,
        **common,
    )
    (video,) = LTX2LatentUpsamplePipeline(vae=ref.vae, latent_upsampler=upsampler)(
        latents=video, output_type="latent", return_dict=False
    )
    if distilled_lora is not None:
        ref.load_lora_weights(
            str(distilled_lora.parent), adapter_name="stage_2_distilled", weight_name=distilled_lora.name
        )
        ref.set_adapters("stage_2_distilled", 1.0)
    base_scheduler = ref.scheduler
    ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        base_scheduler.config, use_dynamic_shifting=False, shift_terminal=None
    )
    try:
        return ref(
            latents=video,
            audio_latents=audio,
            num_inference_steps=len(STAGE_2_DISTILLED_SIGMA_VALUES),
            noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0],
            sigmas=STAGE_2_DISTILLED_SIGMA_VALUES,
            guidance_scale=1.0,
            audio_guidance_scale=1.0,
            output_type="np",
            **common,
        )
    finally:
        ref.scheduler = base_scheduler
        if distilled_lora is not None:
            ref.delete_adapters("stage_2_distilled")


def bench_two_stage(ours, ref, kwargs: dict[str, Any], device) -> dict[str, Any]:
    """The two-stage variant at kwargs' (full) size: ours `two_stage=True`; diffusers' recipe on the same modules."""
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        expected = diffusers_two_stage(ref, ours.latent_upsampler, kwargs, PROMPT, 0)
    sync(device)
    ref_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (out,) = ours.forward(DiffusionRequestBatch([request({**kwargs, "two_stage": True})]))
    sync(device)
    our_s = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(out.error)
    return {
        "what": "two-stage",
        "diffusers_s": ref_s,
        "ours_s": our_s,
        "ratio": our_s / ref_s,
        "psnr_vs_diffusers": psnr(out.output["video"], (expected.frames[0] * 255).round()),
        "audio_snr_vs_diffusers": snr(out.output["audio"], expected.audio[0].float().cpu().numpy()),
        "stages": out.stage_durations,
    }


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['what']} ({r['variant']})" for r in rows]
    ax.barh(labels, [r["ratio"] for r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("ours / diffusers time (lower is faster)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also with the DiT's repeated blocks compiled")
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU (fp32)")
    parser.add_argument(
        "--two-stage",
        action="store_true",
        help="also the two-stage variant at --height x --width (multiples of 64; the base pass at half)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.smoke:
        args.frames, args.height, args.width, args.steps, args.warmup, args.iters = 9, 32, 64, 2, 1, 2
        if args.two_stage:
            args.height, args.width = 64, 128
    kwargs = dict(
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=4.0,
        fps=24,
        max_sequence_length=1024,
    )
    env = environment(device)
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    with vllm_single_rank(device), tempfile.TemporaryDirectory(prefix="ltx2-bench-") as tmp:
        if args.smoke:
            from vllm_omni.catalog.tiny import build_tiny

            ours, ref = load(build_tiny("ltx2"), "auto", device, dtype)
        else:
            ours, ref = load(write_real_size_checkpoint(Path(tmp)), "dummy", device, dtype)
        variants = ["eager"] + (["compiled"] if args.compile else [])
        for variant in variants:
            if variant == "compiled":  # ours as a server runs it (compiled blocks, no CUDA graph), diffusers'
                from vllm_omni.diffusion.layers.compile import accelerate_transformer

                accelerate_transformer(ours.transformer, cuda_graphs=False)
                ref.transformer.compile_repeated_blocks()
            step = bench_step(ours, ref, kwargs, device, args.warmup, args.iters)
            bench_pipeline(ours, ref, {**kwargs, "num_inference_steps": 2}, device)  # warm-up (1 step: NaN)
            pipe = bench_pipeline(ours, ref, kwargs, device)
            measured = [step, pipe]
            if args.two_stage:
                measured.append(bench_two_stage(ours, ref, kwargs, device))
            for row in measured:
                rows.append(
                    {
                        **row,
                        "variant": variant,
                        "frames": args.frames,
                        "size": f"{args.width}x{args.height}",
                        "steps": args.steps,
                    }
                )
                print(json.dumps(rows[-1], default=str), flush=True)
    print(f"\n{'what':<10}{'variant':>10}{'diffusers':>12}{'ours':>11}{'ours/diff':>11}  extra")
    for r in rows:
        unit = "ms" if "ours_ms" in r else "s"
        ref_v, our_v = (r["diffusers_ms"], r["ours_ms"]) if unit == "ms" else (r["diffusers_s"], r["ours_s"])
        extra = (
            ""
            if unit == "ms"
            else (f"PSNR {r['psnr_vs_diffusers']:.1f} dB, audio SNR {r['audio_snr_vs_diffusers']:.1f} dB")
        )
        print(
            f"{r['what']:<10}{r['variant']:>10}{ref_v:>10.1f}{unit:<2}{our_v:>9.1f}{unit:<2}{r['ratio']:>11.2f}  "
            f"{extra}"
        )
    result = {"command": " ".join(sys.argv), "env": env, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        draw(rows, args.png)
    return result


if __name__ == "__main__":
    main()
