"""Single AR stage through `AsyncOmni` vs plain vLLM `AsyncLLM`, same process, same tiny Qwen2 weights.

Start-up (constructor until ready) is the median over rounds that alternate which engine starts first; then warm
per-request latency of 16-token greedy requests is measured in alternating rounds so machine noise hits both.
Token equality is checked on every request. Prints a table and writes JSON to benchmarks/results/.

  .venv/bin/python benchmarks/engine/bench_ar_stage.py --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ENGINE_KWARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True,
                     gpu_memory_utilization=0.15, seed=0)
PROMPT = "A photo of a cat sitting on a red chair"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_omni import AsyncOmni
    from vllm_omni.catalog.tiny import resolve_model

    path = resolve_model("tiny/qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True)

    def start_plain():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **ENGINE_KWARGS))

    def start_omni():
        return AsyncOmni("tiny/qwen2", **ENGINE_KWARGS)

    # Start-up rounds alternate the order (omni, plain, plain, omni, ...) so warm caches favour neither.
    startups: dict[str, list[float]] = {"asyncomni": [], "vllm_asyncllm": []}
    for r in range(args.startup_rounds):
        order = [("asyncomni", start_omni), ("vllm_asyncllm", start_plain)]
        for name, start in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            engine = start()
            startups[name].append(time.perf_counter() - t0)
            engine.close() if name == "asyncomni" else engine.shutdown()
    t0 = time.perf_counter()
    omni = start_omni()
    startups["asyncomni"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    plain = start_plain()
    startups["vllm_asyncllm"].append(time.perf_counter() - t0)
    startup_omni = statistics.median(startups["asyncomni"])
    startup_plain = statistics.median(startups["vllm_asyncllm"])

    async def one_plain(rid: str) -> tuple[float, list[int]]:
        start = time.perf_counter()
        outs = [out async for out in plain.generate(PROMPT, params, rid)]
        return time.perf_counter() - start, list(outs[-1].outputs[0].token_ids)

    async def one_omni(rid: str) -> tuple[float, list[int]]:
        start = time.perf_counter()
        outs = [out async for out in omni.generate(PROMPT, rid, [params])]
        return time.perf_counter() - start, outs[-1].token_ids

    lat_plain, lat_omni, mismatches = [], [], 0
    try:
        for i in range(args.warmup):
            await one_plain(f"wp{i}")
            await one_omni(f"wo{i}")
        for i in range(args.requests):
            order = [(one_plain, lat_plain), (one_omni, lat_omni)]
            if i % 2:
                order.reverse()
            tokens = []
            for fn, sink in order:
                latency, toks = await fn(f"r{i}-{fn.__name__}")
                sink.append(latency)
                tokens.append(toks)
            mismatches += tokens[0] != tokens[1]
    finally:
        omni.close()
        plain.shutdown()

    med_plain, med_omni = statistics.median(lat_plain), statistics.median(lat_omni)
    return {
        "startup_s": {"vllm_asyncllm": startup_plain, "asyncomni": startup_omni},
        "startup_runs_s": startups,
        "latency_ms": {
            name: {"median": statistics.median(v) * 1e3, "mean": statistics.fmean(v) * 1e3,
                   "p90": percentile(v, 0.9) * 1e3, "min": min(v) * 1e3}
            for name, v in (("vllm_asyncllm", lat_plain), ("asyncomni", lat_omni))
        },
        "latency_ratio_median": med_omni / med_plain,
        "startup_delta_s": startup_omni - startup_plain,
        "token_mismatches": mismatches,
        "requests": args.requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--startup-rounds", type=int, default=2,
                        help="extra start/stop rounds per engine, alternating order (median reported)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(run(args))

    lat = result["latency_ms"]
    print(f"\n{'engine':<16}{'startup s':>11}{'median ms':>11}{'mean ms':>10}{'p90 ms':>9}{'min ms':>9}")
    for name in ("vllm_asyncllm", "asyncomni"):
        row = lat[name]
        print(f"{name:<16}{result['startup_s'][name]:>11.1f}{row['median']:>11.2f}{row['mean']:>10.2f}"
              f"{row['p90']:>9.2f}{row['min']:>9.2f}")
    print(f"latency ratio (median) {result['latency_ratio_median']:.3f}x (target <= 1.04x); start-up delta "
          f"{result['startup_delta_s']:+.1f} s (target <= +5 s); token mismatches {result['token_mismatches']}")

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parents[1] / "results" / f"bench_ar_stage-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "command": " ".join(sys.argv), "python": platform.python_version(),
                               "machine": platform.machine(), "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
