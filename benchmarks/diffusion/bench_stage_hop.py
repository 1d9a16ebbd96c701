"""What a diffusion request costs between the caller and the stage: `AsyncOmni` on tiny Qwen-Image (CPU), 2 denoise
steps of a 64x64 image, so the control plane is a visible share of the time. Measures the latency of one request
at a time and the throughput of `--concurrency` requests at once (median of `--repeats` rounds of `--requests`).
Run it on two checkouts to compare them (`--label`; e.g. the engine in the API process vs the diffusion core
process); prints a table and writes JSON (and a PNG with `--plot` when several result files are given) to
benchmarks/results/.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/diffusion/bench_stage_hop.py --label branch
    .venv/bin/python benchmarks/diffusion/bench_stage_hop.py --plot A.json B.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


async def measure(requests: int, concurrency: int, repeats: int) -> dict[str, float]:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omni = AsyncOmni("tiny/qwen-image")
    ids = iter(range(10**9))

    async def one() -> float:
        params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=0)
        start = time.perf_counter()
        outs = [out async for out in omni.generate("a cat", f"r{next(ids)}", [params])]
        assert outs[-1].finished and outs[-1].images
        return time.perf_counter() - start

    try:
        for _ in range(3):  # warm-up: encoders, first forwards
            await one()
        latency, throughput = [], []
        for _ in range(repeats):
            latency.append(statistics.median([await one() for _ in range(requests)]))
            start = time.perf_counter()
            for _ in range(0, requests, concurrency):
                await asyncio.gather(*(one() for _ in range(concurrency)))
            throughput.append(requests / (time.perf_counter() - start))
    finally:
        omni.close()
    return {"latency_ms": statistics.median(latency) * 1000, "throughput_rps": statistics.median(throughput)}


def plot(paths: list[str]) -> None:
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = [run["label"] for run in runs]
    axes[0].bar(labels, [run["latency_ms"] for run in runs])
    axes[0].set_ylabel("ms per request (one at a time)")
    axes[1].bar(labels, [run["throughput_rps"] for run in runs])
    axes[1].set_ylabel(f"requests/s ({runs[0]['concurrency']} at once)")
    fig.suptitle("tiny Qwen-Image through AsyncOmni, CPU")
    fig.tight_layout()
    out = RESULTS / f"stage_hop-{'-vs-'.join(labels)}.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="this-tree")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot these result files instead of running")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
        return
    result = asyncio.run(measure(args.requests, args.concurrency, args.repeats))
    print(f"| label | ms per request (1 at a time) | requests/s ({args.concurrency} at once) |")
    print("|---|---:|---:|")
    print(f"| {args.label} | {result['latency_ms']:.1f} | {result['throughput_rps']:.2f} |")
    record = {
        "label": args.label,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **result,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"stage_hop-{args.label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
