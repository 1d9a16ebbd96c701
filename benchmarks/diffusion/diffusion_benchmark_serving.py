"""Online serving benchmark for diffusion models behind our OpenAI-compatible server (`/v1/images/generations`).

Sends `--num-prompts` requests at a fixed or Poisson arrival rate (or all at once), with at most
`--max-concurrency` in flight, and reports mean/p50/p90/p99 latency, request and image throughput, failures
and the server's per-stage durations. Start the server first, e.g.

  vllm serve black-forest-labs/FLUX.1-dev --omni --port 8091
  python benchmarks/diffusion/diffusion_benchmark_serving.py --base-url http://127.0.0.1:8091 \
      --num-prompts 32 --max-concurrency 4 --size 1024x1024 --num-inference-steps 28 --out serve.json

`--offline-images-per-s` (from bench_pipeline.py on the same machine) adds the serving/offline ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

PROMPTS = (
    "A photo of a cat sitting on a red chair in the morning light",
    "A watercolor painting of mountains above a calm lake",
    "A small robot painting the ocean, studio lighting",
    "A bowl of ramen on a wooden table, top view",
)


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    images: int = 0
    error: str = ""
    stage_durations: dict[str, float] = field(default_factory=dict)


async def send_one(client: httpx.AsyncClient, body: dict[str, Any], timeout: float) -> RequestResult:
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/images/generations", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return RequestResult(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    if resp.status_code != 200:
        return RequestResult(False, latency, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
    payload = resp.json()
    return RequestResult(True, latency, images=len(payload.get("data", [])),
                         stage_durations=payload.get("stage_durations") or {})


def arrival_gaps(n: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Seconds to wait before each request: none for rate=inf, 1/rate (fixed) or exponential (Poisson)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate for _ in range(n)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    fields = {"size": args.size, "n": args.n, "num_inference_steps": args.num_inference_steps, **args.extra}
    fields = {k: v for k, v in fields.items() if v is not None}
    if args.model:
        fields["model"] = args.model
    semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits) as client:
        for i in range(args.warmup):  # first requests pay one-time costs (compile, CUDA-graph capture)
            warm = await send_one(client, {**fields, "prompt": PROMPTS[i % len(PROMPTS)], "seed": i}, args.timeout)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def limited(i: int) -> RequestResult:
            async with semaphore:
                body = {**fields, "prompt": PROMPTS[i % len(PROMPTS)], "seed": args.seed + i}
                return await send_one(client, body, args.timeout)

        tasks = []
        start = time.perf_counter()
        for i, gap in enumerate(arrival_gaps(args.num_prompts, args.request_rate, args.arrival, args.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    lat = np.array([r.latency_s for r in ok]) if ok else np.array([float("nan")])
    stages: dict[str, list[float]] = {}
    for r in ok:
        for name, secs in r.stage_durations.items():
            stages.setdefault(name, []).append(secs)
    images = sum(r.images for r in ok)
    summary = {
        "num_prompts": args.num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "request_rate": args.request_rate, "arrival": args.arrival, "max_concurrency": args.max_concurrency,
        "duration_s": duration, "requests_per_s": len(ok) / duration, "images_per_s": images / duration,
        "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p90_s": float(np.percentile(lat, 90)), "latency_p99_s": float(np.percentile(lat, 99)),
        "stage_durations_mean_s": {k: float(np.mean(v)) for k, v in stages.items()},
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if args.offline_images_per_s:
        summary["serving_over_offline"] = summary["images_per_s"] / args.offline_images_per_s
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8091")
    parser.add_argument("--model", default=None, help="model name sent in the body (default: the server's)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    parser.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--size", default="1024x1024")
    parser.add_argument("--n", type=int, default=1, help="images per request")
    parser.add_argument("--num-inference-steps", type=int, default=None)
    parser.add_argument("--extra", type=json.loads, default={}, help="more body fields as a JSON object")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--offline-images-per-s", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    result = {"command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    print(f"{'completed':>10}{'failed':>8}{'req/s':>8}{'img/s':>8}{'mean s':>9}{'p50 s':>8}{'p90 s':>8}{'p99 s':>8}")
    print(f"{summary['completed']:>10}{summary['failed']:>8}{summary['requests_per_s']:>8.3f}"
          f"{summary['images_per_s']:>8.3f}{summary['latency_mean_s']:>9.3f}{summary['latency_p50_s']:>8.3f}"
          f"{summary['latency_p90_s']:>8.3f}{summary['latency_p99_s']:>8.3f}")
    print("stage durations (mean s):", json.dumps(summary["stage_durations_mean_s"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
