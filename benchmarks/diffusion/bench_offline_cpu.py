"""Warm per-request latency of the diffusion runtime vs plain diffusers on CPU, side by side in one run.

Same tiny-family Qwen-Image checkpoint, prompt, negative prompt (true CFG), seed and fp32 everywhere; one
request at a time, the paths interleaved so background load hits them alike. Columns:
  diffusers        `QwenImagePipeline.__call__` in this process (the reference)
  engine+adapter   the same diffusers code run by `DiffusionEngine` in a worker process: the runtime's own cost
  engine+native    our `QwenImagePipeline` through `DiffusionEngine`
  Omni             `Omni.generate` with our pipeline (control plane + engine + worker)
Prints a table (medians; ratio to diffusers) and writes benchmarks/results/bench_offline_cpu-<UTC>.json.
"overhead" is per request: latency seen by the caller minus the worker's own forward time for that request
(scheduling, IPC and result hand-off), which background load disturbs far less than the path ratios.

    .venv/bin/python benchmarks/diffusion/bench_offline_cpu.py [--iters 20] [--configs tiny mid] [--no-omni]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

# Several processes share the cores here (diffusers in this process, one worker per engine). OpenMP threads that
# spin after each parallel region (libiomp's default 200 ms block time) steal the cores the next path needs and
# make the interleaved paths slow each other down. Passive waiting applies to every path alike; set before torch
# loads, and inherited by the spawned workers.
os.environ.setdefault("KMP_BLOCKTIME", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

CONFIGS = {
    # name: (tiny builder overrides, image side)
    "tiny": ({}, 64),
    "mid": ({"hidden_size": 256, "num_layers": 4, "num_heads": 8, "vae_base_dim": 8}, 128),
}
PROMPT, NEGATIVE, STEPS, SEED, TRUE_CFG = "a lighthouse on a cliff at dusk, oil painting", "blurry", 4, 0, 4.0
_ids = itertools.count()


def _make_paths(model_dir: Path, side: int, with_omni: bool) -> tuple[dict[str, Callable[[], float | None]], list]:
    """Each path runs one request and returns the worker-side forward seconds (None for diffusers)."""
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

    def run_diffusers() -> None:
        ref(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=TRUE_CFG, height=side, width=side,
            num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED))

    paths: dict[str, Callable[[], float | None]] = {"diffusers": run_diffusers}
    for name, adapter in (("engine+adapter", True), ("engine+native", False)):
        engine = DiffusionEngine(OmniDiffusionConfig(model=str(model_dir), dtype="float32",
                                                     use_diffusers_adapter=adapter))
        closers.append(engine.close)

        def run(engine=engine) -> float:
            out = engine.submit(OmniDiffusionRequest(prompt, params, f"bench-{next(_ids)}")).result(600)
            assert out.error is None, out.error
            return out.stage_durations["forward"]

        paths[name] = run
    if with_omni:
        from vllm_omni import Omni

        omni = Omni(model=str(model_dir), dtype="float32")
        closers.append(omni.close)

        def run_omni() -> float:
            (out,) = omni.generate([prompt], params, use_tqdm=False)
            assert out.error is None, out.error
            return out.stage_durations["diffusion.forward"]

        paths["Omni"] = run_omni
    return paths, closers


def bench_config(name: str, iters: int, with_omni: bool) -> dict:
    from vllm_omni.catalog.tiny import build_tiny

    overrides, side = CONFIGS[name]
    model_dir = build_tiny("qwen-image", **overrides)
    paths, closers = _make_paths(model_dir, side, with_omni)
    try:
        for run in paths.values():  # warm-up
            run()
            run()
        times: dict[str, list[float]] = {path: [] for path in paths}
        overheads: dict[str, list[float]] = {path: [] for path in paths if path != "diffusers"}
        for _ in range(iters):
            for path, run in paths.items():
                start = time.perf_counter()
                forward_s = run()
                elapsed = time.perf_counter() - start
                times[path].append(elapsed * 1000)
                if forward_s is not None:
                    overheads[path].append((elapsed - forward_s) * 1000)
    finally:
        for close in closers:
            close()
    medians = {path: statistics.median(ms) for path, ms in times.items()}
    return {"config": name, "size": side, "steps": STEPS, "iters": iters, "median_ms": medians,
            "ratio_to_diffusers": {p: m / medians["diffusers"] for p, m in medians.items()},
            "runtime_overhead_ms": {p: statistics.median(o) for p, o in overheads.items()},
            "samples_ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--no-omni", action="store_true", help="skip the Omni column")
    args = parser.parse_args()
    rows = [bench_config(name, args.iters, not args.no_omni) for name in args.configs]

    paths = list(rows[0]["median_ms"])
    print("\nmedian warm latency per request, ms (ratio to diffusers) [runtime overhead per request, ms]")
    print(f"{'config':<6} {'size':>5} " + " ".join(f"{p:>30}" for p in paths))
    for r in rows:
        cells = []
        for p in paths:
            extra = f" [{r['runtime_overhead_ms'][p]:.1f}]" if p in r["runtime_overhead_ms"] else ""
            cells.append(f"{r['median_ms'][p]:.1f} ({r['ratio_to_diffusers'][p]:.2f}x){extra}")
        print(f"{r['config']:<6} {r['size']:>5} " + " ".join(f"{c:>30}" for c in cells))
    out = Path(__file__).resolve().parents[1] / "results"
    out.mkdir(exist_ok=True)
    path = out / f"bench_offline_cpu-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    load = os.getloadavg()
    print(f"load average during the run (1/5/15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    path.write_text(json.dumps({"command": sys.argv, "rows": rows, "torch": torch.__version__, "loadavg": load,
                                "platform": platform.platform(), "torch_threads": torch.get_num_threads()},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
