"""Warm per-request latency of the diffusion runtime vs plain diffusers on CPU, side by side in one run.

Same tiny-family Qwen-Image checkpoint, prompt, negative prompt (true CFG), seed and fp32 everywhere; one
request at a time, the paths interleaved so background load hits them alike. Columns:
  diffusers        `QwenImagePipeline.__call__` in this process (the reference)
  engine+adapter   the same diffusers code run by `DiffusionEngine` in a worker process: the runtime's own cost
  engine+native    our `QwenImagePipeline` through `DiffusionEngine`
  Omni             `Omni.generate` with our pipeline (control plane + engine + worker)
Prints a table (medians; ratio to diffusers) and writes benchmarks/results/bench_offline_cpu-<UTC>.json.

    .venv/bin/python benchmarks/diffusion/bench_offline_cpu.py [--iters 20] [--configs tiny mid] [--no-omni]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

CONFIGS = {
    # name: (tiny builder overrides, image side)
    "tiny": ({}, 64),
    "mid": ({"hidden_size": 256, "num_layers": 4, "num_heads": 8, "vae_base_dim": 8}, 128),
}
PROMPT, NEGATIVE, STEPS, SEED, TRUE_CFG = "a lighthouse on a cliff at dusk, oil painting", "blurry", 4, 0, 4.0
_ids = itertools.count()


def _make_paths(model_dir: Path, side: int, with_omni: bool) -> tuple[dict[str, Callable[[], None]], list]:
    from diffusers import QwenImagePipeline

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    params = OmniDiffusionSamplingParams(height=side, width=side, num_inference_steps=STEPS, true_cfg_scale=TRUE_CFG,
                                         seed=SEED)
    prompt = {"prompt": PROMPT, "negative_prompt": NEGATIVE}
    ref = QwenImagePipeline.from_pretrained(model_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    closers: list = []
    paths: dict[str, Callable[[], None]] = {
        "diffusers": lambda: ref(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=TRUE_CFG, height=side, width=side,
                                 num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED)),
    }
    for name, adapter in (("engine+adapter", True), ("engine+native", False)):
        engine = DiffusionEngine(OmniDiffusionConfig(model=str(model_dir), dtype="float32",
                                                     use_diffusers_adapter=adapter))
        closers.append(engine.close)

        def run(engine=engine) -> None:
            out = engine.submit(OmniDiffusionRequest(prompt, params, f"bench-{next(_ids)}")).result(600)
            assert out.error is None, out.error

        paths[name] = run
    if with_omni:
        from vllm_omni import Omni

        omni = Omni(model=str(model_dir), dtype="float32")
        closers.append(omni.close)

        def run_omni() -> None:
            (out,) = omni.generate([prompt], params, use_tqdm=False)
            assert out.error is None, out.error

        paths["Omni"] = run_omni
    return paths, closers


def bench_config(name: str, iters: int, with_omni: bool) -> dict:
    from vllm_omni.testing.tiny_models import build_tiny

    overrides, side = CONFIGS[name]
    model_dir = build_tiny("qwen-image", **overrides)
    paths, closers = _make_paths(model_dir, side, with_omni)
    try:
        for run in paths.values():  # warm-up
            run()
            run()
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(iters):
            for path, run in paths.items():
                start = time.perf_counter()
                run()
                times[path].append((time.perf_counter() - start) * 1000)
    finally:
        for close in closers:
            close()
    medians = {path: statistics.median(ms) for path, ms in times.items()}
    return {"config": name, "size": side, "steps": STEPS, "iters": iters, "median_ms": medians,
            "ratio_to_diffusers": {p: m / medians["diffusers"] for p, m in medians.items()},
            "overhead_ms": {p: m - medians["diffusers"] for p, m in medians.items()},
            "samples_ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--no-omni", action="store_true", help="skip the Omni column")
    args = parser.parse_args()
    rows = [bench_config(name, args.iters, not args.no_omni) for name in args.configs]

    paths = list(rows[0]["median_ms"])
    print("\nmedian warm latency per request, ms (ratio to diffusers)")
    print(f"{'config':<6} {'size':>5} " + " ".join(f"{p:>22}" for p in paths))
    for r in rows:
        cells = [f"{r['median_ms'][p]:>13.1f} ({r['ratio_to_diffusers'][p]:.2f}x)" for p in paths]
        print(f"{r['config']:<6} {r['size']:>5} " + " ".join(f"{c:>22}" for c in cells))
    out = Path(__file__).resolve().parents[1] / "results"
    out.mkdir(exist_ok=True)
    path = out / f"bench_offline_cpu-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"command": sys.argv, "rows": rows, "torch": torch.__version__,
                                "platform": platform.platform(), "torch_threads": torch.get_num_threads()},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
