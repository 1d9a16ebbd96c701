"""Start-up warm-up and serving-time compile stalls of the compiled path, in ONE run (issue 26 "No stalls" and
"First request after ready" / "restart with a warm cache dir" targets).

Three server builds of the same model and flags, one after the other:
(a) eager (`--enforce-eager`): seconds until /health answers;
(b) compiled, cold compile cache dir (`--diffusion-compile-cache-dir`, empty): seconds to ready (the warm-up
    runs before /health says ready), then the first request after ready vs the median of the next ones (steady
    state), a burst of 4 concurrent requests of new prompts vs the same burst repeated, and `--num-mixed`
    requests of random prompts (5-200 tokens), the `--sizes` and random burst compositions (1-4 at once), counting
    the serving-time compile WARNINGs of the server log and the serving-phase compile / capture counters of its
    /metrics;
(c) compiled again on the same cache dir (restart): seconds to ready.
Writes JSON (command, results) to `--out`, a PNG beside it, and the three server logs.

  python3 benchmarks/diffusion/write_config_only_checkpoint.py --model qwen-image --out /tmp/qi
  python3 benchmarks/diffusion/bench_warmup.py --model /tmp/qi --load-format dummy --sizes 512x512,1024x1024 \\
      --max-num-seqs 4 --step-execution --out warmup.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffusion_benchmark_serving import Server, _free_port, send_one  # noqa: E402

STALL_MARK = "compile while serving"
WORDS = ("cat", "dog", "red", "blue", "sky", "sea", "city", "night", "tree", "sun", "rain", "road", "house",
         "light", "river", "snow", "old", "man", "boat", "green")
"""Common English words, one BPE token each (with their leading space): a prompt of n of them is ~n tokens."""
SERVING_SERIES = ("vllm_omni:diffusion_graph_compiles_total", "vllm_omni:diffusion_cuda_graph_captures_total")


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))


async def serving_counts(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's serving-phase compile and capture counters (/metrics)."""
    text = (await client.get("/metrics")).text
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{") and 'phase="serving"' in line) for name in SERVING_SERIES}


def flags(args: argparse.Namespace, eager: bool, cache_dir: str) -> list[str]:
    out = ["--load-format", args.load_format, "--max-num-seqs", str(args.max_num_seqs),
           "--diffusion-warmup-shapes", args.sizes, "--diffusion-compile-cache-dir", cache_dir]
    if eager:
        out.append("--enforce-eager")
    if args.step_execution:
        out.append("--step-execution")
    return out


def start(args: argparse.Namespace, name: str, eager: bool, cache_dir: str) -> tuple[Server, float]:
    server = Server(args.model, _free_port(), flags(args, eager, cache_dir), args.out.with_name(f"{name}.log"))
    begin = time.monotonic()
    server.wait_ready()
    return server, time.monotonic() - begin


async def probe(server: Server, args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fills `report` as it goes (a run cut short keeps what it measured)."""
    rng = random.Random(args.seed)
    size = args.sizes.split(",")[0]
    one = {"size": size, "num_inference_steps": args.steps}
    async with httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=8)) as client:

        async def timed(bodies: list[dict[str, Any]]) -> float:
            begin = time.perf_counter()
            results = await asyncio.gather(*(send_one(client, b, args.timeout) for b in bodies))
            bad = [r.error for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"request failed: {bad[0]}")
            return time.perf_counter() - begin

        first = await timed([{**one, "prompt": "a red fox in the snow", "seed": 0}])
        steady = [await timed([{**one, "prompt": "a red fox in the snow", "seed": i}]) for i in range(1, 6)]
        report.update(first_request_s=first, steady_median_s=statistics.median(steady), steady_s=steady,
                      first_over_steady=first / statistics.median(steady))
        burst = [{**one, "prompt": random_prompt(rng), "seed": i} for i in range(4)]
        burst_new = await timed(burst)
        burst_again = await timed(burst)
        report.update(burst_new_s=burst_new, burst_repeated_s=burst_again,
                      burst_new_over_repeated=burst_new / burst_again)
        log = server.log.name
        counts_before = await serving_counts(client)
        stalls_before = Path(log).read_text(errors="replace").count(STALL_MARK)
        sizes = args.sizes.split(",")
        sent, mixed = 0, []
        while sent < args.num_mixed:
            n = min(rng.randint(1, 4), args.num_mixed - sent)
            bodies = [{"size": rng.choice(sizes), "num_inference_steps": args.mixed_steps,
                       "prompt": random_prompt(rng), "seed": sent + i} for i in range(n)]
            mixed.append(await timed(bodies))
            sent += n
            report.update(mixed_requests=sent, mixed_bursts_s=mixed)
        server.log.flush()
        stalls = Path(log).read_text(errors="replace").count(STALL_MARK) - stalls_before
        counts = await serving_counts(client)
    report.update(serving_time_compile_warnings=stalls,
                  serving_time_compile_warnings_since_ready=Path(log).read_text(errors="replace").count(STALL_MARK),
                  serving_metrics_increase={k: counts[k] - counts_before[k] for k in SERVING_SERIES},
                  serving_metrics_since_ready=counts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--sizes", default="512x512", help="warm-up shapes, also the sizes of the mixed requests")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--step-execution", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="steps of the first/steady/burst requests")
    parser.add_argument("--mixed-steps", type=int, default=4, help="steps of the mixed requests")
    parser.add_argument("--num-mixed", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled-only", action="store_true",
                        help="build (b) only: no eager start-up, no restart on the warm cache dir")
    parser.add_argument("--out", type=Path, default=Path("warmup.json"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as cache_dir:
        if not args.compiled_only:
            server, report["eager_ready_s"] = start(args, "eager", True, cache_dir)
            server.close()
            save()
        server, report["cold_ready_s"] = start(args, "compiled_cold", False, cache_dir)
        try:
            asyncio.run(probe(server, args, report))
        finally:
            server.close()
            save()
        if not args.compiled_only:
            server, report["warm_cache_ready_s"] = start(args, "compiled_warm_cache", False, cache_dir)
            server.close()
            report["warm_cache_over_eager"] = report["warm_cache_ready_s"] / report["eager_ready_s"]
    save()
    for key in ("eager_ready_s", "cold_ready_s", "warm_cache_ready_s", "warm_cache_over_eager", "first_request_s",
                "steady_median_s", "first_over_steady", "burst_new_s", "burst_repeated_s",
                "burst_new_over_repeated", "mixed_requests", "serving_time_compile_warnings",
                "serving_time_compile_warnings_since_ready", "serving_metrics_increase", "serving_metrics_since_ready"):
        value = report.get(key)
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    plot(report, args.out.with_suffix(".png"))
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    builds = [(name, report[key]) for name, key in (("eager", "eager_ready_s"), ("compiled cold", "cold_ready_s"),
                                                    ("compiled warm cache", "warm_cache_ready_s")) if key in report]
    a.bar([name for name, _ in builds], [seconds for _, seconds in builds])
    a.set_ylabel("seconds to /health ready")
    b.bar(["first after ready", "steady median", "burst new", "burst repeated"],
          [report["first_request_s"], report["steady_median_s"], report["burst_new_s"], report["burst_repeated_s"]])
    b.set_ylabel("seconds")
    b.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
