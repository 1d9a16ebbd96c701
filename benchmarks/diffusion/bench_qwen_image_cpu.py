"""Warm per-request latency of Qwen-Image on CPU: plain diffusers vs our pipeline vs `Omni`, same run.

Same tiny-family checkpoint, weights, prompt, seed and fp32 for all three; requests run one at a time with
true CFG (a negative prompt). Columns: diffusers `QwenImagePipeline.__call__`; our `QwenImagePipeline.forward`
in-process (the model alone); `Omni.generate` (engine, scheduler, worker process, IPC included).
Prints a table and writes benchmarks/results/bench_qwen_image_cpu-<UTC>.json.

    .venv/bin/python benchmarks/diffusion/bench_qwen_image_cpu.py [--iters 20] [--configs tiny mid]
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

CONFIGS = {
    # name: (tiny builder overrides, image side)
    "tiny": ({}, 64),
    "mid": ({"hidden_size": 256, "num_layers": 4, "num_heads": 8, "vae_base_dim": 8}, 128),
}
PROMPT, NEGATIVE, STEPS, SEED = "a lighthouse on a cliff at dusk, oil painting", "blurry, low quality", 4, 0


def _timed(fn, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _init_dist() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1)


def bench_config(name: str, iters: int, with_omni: bool) -> dict:
    from diffusers import QwenImagePipeline as Reference

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    overrides, side = CONFIGS[name]
    model_dir = build_tiny("qwen-image", **overrides)
    params = OmniDiffusionSamplingParams(height=side, width=side, num_inference_steps=STEPS, true_cfg_scale=4.0,
                                         negative_prompt=NEGATIVE, seed=SEED)
    ref = Reference.from_pretrained(model_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ours = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir,
                                             torch.device("cpu"), torch.float32)

    def run_ref():
        ref(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, height=side, width=side, num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(SEED))

    def run_ours():
        with torch.inference_mode():
            ours.forward(DiffusionRequestBatch([OmniDiffusionRequest(PROMPT, params, "bench")]))

    runners = {"diffusers_ms": run_ref, "pipeline_ms": run_ours}
    omni = None
    if with_omni:
        from vllm_omni import Omni

        omni = Omni(model=str(model_dir), dtype="float32")
        runners["omni_ms"] = lambda: omni.generate([PROMPT], params, use_tqdm=False)
    try:
        # Round-robin so background load hits every column alike.
        times: dict[str, list[float]] = {key: [] for key in runners}
        for i in range(iters):
            for key, fn in runners.items():
                times[key] += _timed(fn, 1, warmup=2 if i == 0 else 0)
    finally:
        if omni is not None:
            omni.close()
    return {"config": name, "size": side, "steps": STEPS, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--no-omni", action="store_true", help="skip the full-engine column")
    args = parser.parse_args()
    torch.manual_seed(0)
    _init_dist()
    rows = [bench_config(name, args.iters, not args.no_omni) for name in args.configs]

    print(f"\n{'config':<6} {'size':>5} {'diffusers ms':>13} {'pipeline ms':>12} {'x':>6} {'Omni ms':>9} {'x':>6}")
    for r in rows:
        omni = r.get("omni_ms")
        print(f"{r['config']:<6} {r['size']:>5} {r['diffusers_ms']:>13.1f} {r['pipeline_ms']:>12.1f} "
              f"{r['pipeline_ms'] / r['diffusers_ms']:>6.2f} "
              + (f"{omni:>9.1f} {omni / r['diffusers_ms']:>6.2f}" if omni else f"{'-':>9} {'-':>6}"))
    out = Path(__file__).resolve().parents[1] / "results"
    out.mkdir(exist_ok=True)
    path = out / f"bench_qwen_image_cpu-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"command": sys.argv, "rows": rows, "torch": torch.__version__,
                                "platform": platform.platform(), "cpu_count": torch.get_num_threads()}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
