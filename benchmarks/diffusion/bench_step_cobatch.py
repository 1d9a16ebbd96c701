"""Step mode on CPU: resident states co-batched into one transformer forward vs one forward per state.

Tiny "mid" Qwen-Image (hidden 256, 4 layers, fp32) with true CFG at 256x256 (256 image tokens per row, as real
Qwen-Image at 256^2) and 512x512 (1024 tokens); 1, 2, 4 and 8 resident states (different prompts and seeds)
at their steps. A round is every state taking one denoise step: `denoise_step` per state (what
`--diffusion-max-tokens-per-forward 1` runs) vs one `denoise_step_batch` over all of them (the default);
rounds alternate between the two (and which goes first) so background load hits both alike. Prints a table
(median ms per round, ms per state-step, per-state/co-batched ratio) and writes JSON and a PNG (if matplotlib
is installed) to benchmarks/results/.

    .venv/bin/python benchmarks/diffusion/bench_step_cobatch.py [--iters 10] [--sizes 256 512] [--batches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

MID = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "vae_base_dim": 8}
PROMPTS = ["a lighthouse on a cliff at dusk, oil painting", "a red bicycle in the rain", "a bowl of ramen",
           "a snowy forest at night with a full moon and tall pine trees", "a cat", "an astronaut riding a horse",
           "a city skyline, watercolor", "a glass of water on a wooden table, studio light"]


def _init_dist() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1)


def _states(pipe, side: int, batch: int, steps: int):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    states, ctxs = [], []
    for i in range(batch):
        sp = OmniDiffusionSamplingParams(height=side, width=side, num_inference_steps=steps, true_cfg_scale=4.0,
                                         seed=i)
        request = OmniDiffusionRequest({"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": "blurry"}, sp,
                                       f"r{i}")
        ctx = StepContext(pipe.od_config, request_ids=[request.request_id])
        states.append(pipe.prepare([request], ctx))
        ctxs.append(ctx)
    return states, ctxs


def bench(pipe, side: int, batch: int, iters: int) -> dict:
    """Median ms of one round, per-state forwards and co-batched, on the same resident states."""
    states, ctxs = _states(pipe, side, batch, steps=2 * (iters + 1))
    modes = {
        "per_state": lambda: [pipe.denoise_step(s, c) for s, c in zip(states, ctxs, strict=True)],
        "cobatched": lambda: pipe.denoise_step_batch(states, ctxs),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(iters + 1):
        for mode, fn in (modes.items() if i % 2 else reversed(modes.items())):  # neither always goes first
            start = time.perf_counter()
            errors = fn()
            elapsed = (time.perf_counter() - start) * 1000
            if mode == "cobatched" and any(errors):
                raise RuntimeError(f"co-batched step failed: {errors}")
            if i:  # the first round of each mode is warm-up
                times[mode].append(elapsed)
    per_state, cobatched = (statistics.median(times[m]) for m in modes)
    image_tokens = sum(f * h * w for f, h, w in states[0].conditioning.geometry.img_shapes)
    return {"size": side, "image_tokens": image_tokens, "batch": batch,
            "tokens_per_forward": sum(pipe.step_tokens(s) for s in states),
            "per_state_round_ms": per_state, "cobatched_round_ms": cobatched,
            "per_state_ms_per_step": per_state / batch, "cobatched_ms_per_step": cobatched / batch,
            "speedup": per_state / cobatched}


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side in sorted({r["size"] for r in rows}):
        sub = [r for r in rows if r["size"] == side]
        ax.plot([r["batch"] for r in sub], [r["speedup"] for r in sub], marker="o", label=f"{side}x{side}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="resident states (true CFG)", ylabel="per-state forwards / co-batched (round time)",
           title="Step mode co-batching, tiny mid Qwen-Image, CPU fp32", xscale="log", xticks=[1, 2, 4, 8])
    ax.minorticks_off()
    ax.set_xticklabels(["1", "2", "4", "8"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    torch.manual_seed(0)
    _init_dist()
    model_dir = build_tiny("qwen-image", **MID)
    pipe = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir,
                                             torch.device("cpu"), torch.float32)
    rows = []
    with torch.inference_mode():
        for side in args.sizes:
            for batch in args.batches:
                rows.append(bench(pipe, side, batch, args.iters))
                print(f"{side}^2 batch {batch}: ratio {rows[-1]['speedup']:.2f}", file=sys.stderr, flush=True)

    print(f"\n{'size':>5} {'img tok':>7} {'batch':>5} {'tokens':>7} {'per-state ms':>12} {'co-batched ms':>13} "
          f"{'ms/step ps':>10} {'ms/step cb':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['size']:>5} {r['image_tokens']:>7} {r['batch']:>5} {r['tokens_per_forward']:>7} "
              f"{r['per_state_round_ms']:>12.1f} {r['cobatched_round_ms']:>13.1f} {r['per_state_ms_per_step']:>10.1f} "
              f"{r['cobatched_ms_per_step']:>10.1f} {r['speedup']:>6.2f}")
    out = Path(__file__).resolve().parents[1] / "results"
    out.mkdir(exist_ok=True)
    stem = f"bench_step_cobatch-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
    (out / f"{stem}.json").write_text(json.dumps({
        "command": sys.argv, "model": {"family": "qwen-image", **MID}, "true_cfg": True, "rows": rows,
        "torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads()},
        indent=2))
    print(f"wrote {out / stem}.json" + (f" and {stem}.png" if plot(rows, out / f"{stem}.png") else
                                          " (no PNG: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
