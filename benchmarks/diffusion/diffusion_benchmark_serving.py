"""Online serving benchmark for diffusion models behind our OpenAI-compatible server (`/v1/images/generations`).

Sends `--num-prompts` requests at a fixed or Poisson arrival rate (or all at once), with at most
`--max-concurrency` in flight, and reports mean/p50/p90/p99 latency, request and image throughput, failures
and the server's per-stage durations. Start the server first, e.g.

  vllm serve black-forest-labs/FLUX.1-dev --omni --port 8091
  python benchmarks/diffusion/diffusion_benchmark_serving.py --base-url http://127.0.0.1:8091 \
      --num-prompts 32 --max-concurrency 4 --size 1024x1024 --num-inference-steps 28 --out serve.json

`--offline-images-per-s` (from bench_pipeline.py on the same machine) adds the serving/offline ratio.

`--compare-modes MODEL` instead starts `vllm serve MODEL --omni` itself, once per execution mode (`--modes`:
request-mode FCFS, step-mode FCFS, step-mode SLO; same build, same flags otherwise, the same `--max-num-seqs`
for all three: request mode co-batches too), and replays one seeded
Poisson schedule of a mix of sizes and step counts against each (`--num-prompts`, 40 by default). The offered
rate is `--request-rate`, else `--load` x the request-mode server's measured throughput: `--calibration-burst`
requests of random classes of the mix, `--max-num-seqs` of them in flight at a time (so that load 0.8 is 0.8 of
what request mode serves with the co-batching random arrivals allow; the capacity from the mean solo latency is
reported beside). Solo latencies (median of `--calibration-reps` after a warm-up) set the deadlines and the
simulator's step costs: `sim_step_policies.py`'s prediction for the same mix, load and `slo` policy is printed
and stored beside the measurement (`simulated`). Every server warms up the mix's sizes
(`--diffusion-warmup-shapes`, unless `--server-args` sets it). Each request's deadline is 2x its
class's solo latency (sent as `deadline_ms`); the table gives mean/p50/p95/p99 latency, throughput, deadline
attainment and the 1-minute load average per mode, the same per class, and issue 26's targets (met / not met)
for each step mode against request FCFS. The JSON and a latency-CDF PNG go to `--results-dir`:

  python benchmarks/diffusion/diffusion_benchmark_serving.py --compare-modes /path/to/checkpoint \
      --num-prompts 40 --mix 128x128:8,128x128:24,256x256:12

`--rounds K` runs the modes K times in turn (request FCFS, step FCFS, step SLO, request FCFS, ...), round r
replaying the plan of seed `--seed` + r, so that the noise of a shared machine drifts over every mode alike;
the table pools the rounds and lists each round's ratios. `--smoke` (3 prompts, no calibration reps) checks
the path end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
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


# ---- --compare-modes -------------------------------------------------------------------------------------------

MODES = {
    "request-fcfs": [],
    "step-fcfs": ["--step-execution", "--diffusion-scheduler-policy", "fcfs"],
    "step-slo": ["--step-execution", "--diffusion-scheduler-policy", "slo"],
    "step-slo-admit": ["--step-execution", "--diffusion-scheduler-policy", "slo", "--slo-admission-control"],
}
STARTUP_TIMEOUT_S = 900.0


def parse_mix(text: str) -> list[tuple[str, int]]:
    """"128x128:8,256x256:20" -> [("128x128", 8), ("256x256", 20)]."""
    return [(size, int(steps)) for size, steps in (item.split(":") for item in text.split(","))]


class Server:
    """`vllm serve MODEL --omni` in its own process group, ready once /health answers 200 (started as the module
    that command runs, so that it works where vLLM's `vllm` script is not installed, e.g. the GPU image)."""

    def __init__(self, model: str, port: int, flags: list[str], log: Path) -> None:
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", model, "--omni", "--host",
               "127.0.0.1", "--port", str(port), *flags]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1.0)
        raise TimeoutError(f"server not ready in {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def body(args: argparse.Namespace, i: int, size: str, steps: int, deadline_s: float | None) -> dict[str, Any]:
    out = {"prompt": PROMPTS[i % len(PROMPTS)], "seed": args.seed + i, "size": size, "num_inference_steps": steps,
           **args.extra}
    if deadline_s is not None:
        out["deadline_ms"] = round(deadline_s * 1000.0, 3)
    return out


async def solo_latencies(client: httpx.AsyncClient, args: argparse.Namespace, mix: list[tuple[str, int]],
                         reps: int) -> list[float]:
    """Median latency of each class sent alone on an idle server, after one warm-up request per class (reps=0:
    the warm-up only)."""
    out = []
    for size, steps in mix:
        times = []
        for rep in range(reps + 1):
            result = await send_one(client, body(args, rep, size, steps, None), args.timeout)
            if not result.ok:
                raise RuntimeError(f"calibration request failed: {result.error}")
            times.append(result.latency_s)
        out.append(float(np.median(times[1:] or times)))
    return out


async def replay(client: httpx.AsyncClient, args: argparse.Namespace, plan: list[tuple[float, int]],
                 mix: list[tuple[str, int]], deadlines: list[float]) -> tuple[list[RequestResult], float]:
    async def one(i: int, cls: int) -> RequestResult:
        return await send_one(client, body(args, i, *mix[cls], deadlines[cls]), args.timeout)

    tasks = []
    start = time.perf_counter()
    for i, (gap, cls) in enumerate(plan):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(i, cls)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def mode_summary(results: list[RequestResult], plan: list[tuple[float, int]], deadlines: list[float],
                 duration: float, mix: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """Latency, throughput and deadline attainment of one mode's replay, overall and per class of `mix`."""
    ok = [(r, cls) for r, (_, cls) in zip(results, plan, strict=True) if r.ok]
    lat = np.array([r.latency_s for r, _ in ok]) if ok else np.array([float("nan")])
    made = sum(r.latency_s <= deadlines[cls] for r, cls in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "throughput_rps": len(ok) / duration, "latency_mean_s": float(lat.mean()),
               **{f"latency_p{q}_s": float(np.percentile(lat, q)) for q in (50, 95, 99)},
               "deadline_attainment": made / len(results), "latencies_s": lat.tolist(),
               "errors": sorted({r.error for r in results if not r.ok})[:5]}
    if mix is not None:
        summary["per_class"] = {}
        for cls, (size, steps) in enumerate(mix):
            mine = [r.latency_s for r, c in ok if c == cls]
            sent = sum(c == cls for _, c in plan)
            if sent:
                summary["per_class"][f"{size}:{steps}"] = {
                    "sent": sent, "completed": len(mine), "latency_mean_s": float(np.mean(mine)) if mine else None,
                    "latency_p95_s": float(np.percentile(mine, 95)) if mine else None,
                    "deadline_attainment": sum(x <= deadlines[cls] for x in mine) / sent}
    return summary


def target_checks(base: dict[str, Any], m: dict[str, Any], min_throughput_ratio: float) -> dict[str, bool]:
    """Issue 26's targets for a step mode against request-mode FCFS: mean <= 0.8x, p95 <= 1.1x, the short class's
    mean (the smallest size x steps of the mix) <= 0.5x, throughput >= `min_throughput_ratio` x (0.98; 1.3 for the
    256^2 throughput run), deadline attainment >= request FCFS's + 20 points."""
    checks = {"mean<=0.8x": m["latency_mean_s"] <= 0.8 * base["latency_mean_s"],
              "p95<=1.1x": m["latency_p95_s"] <= 1.1 * base["latency_p95_s"]}
    classes = base.get("per_class", {})
    if len(classes) > 1:
        short = min(classes, key=_class_cost)
        checks[f"{short} mean<=0.5x"] = (m["per_class"][short]["latency_mean_s"] or float("inf")) <= 0.5 * (
            classes[short]["latency_mean_s"] or 0.0)
    goal = min(1.0, base["deadline_attainment"] + 0.2)
    checks[f"attainment>={goal:.0%}"] = m["deadline_attainment"] >= goal
    checks[f"throughput>={min_throughput_ratio:g}x"] = m["throughput_rps"] >= min_throughput_ratio * base[
        "throughput_rps"]
    return checks


def _class_cost(name: str) -> int:
    """Pixels x steps of a mix class named "WxH:STEPS"."""
    size, steps = name.split(":")
    width, height = size.split("x")
    return int(width) * int(height) * int(steps)


async def compare_modes(args: argparse.Namespace) -> dict[str, Any]:
    mix = parse_mix(args.mix)
    modes = args.modes.split(",")
    if modes[0] != "request-fcfs" or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: request-fcfs first (it calibrates the load), then any of {list(MODES)[1:]}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.results_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
                              "modes": {}}
    plan: list[tuple[float, int]] = []
    deadlines: list[float] = []
    runs: dict[str, list[tuple[list[RequestResult], list[tuple[float, int]], float, list[float]]]] = {
        mode: [] for mode in modes}
    out = args.out or args.results_dir / f"diffusion_serving_modes-{stamp}.json"
    signal.signal(signal.SIGTERM, _interrupt)  # so that `finally` stops the running server
    for rnd in range(args.rounds):  # modes interleaved round by round, so drifting machine noise hits them all
        if rnd:
            plan = poisson_plan(report["request_rate"], args.num_prompts, len(mix), args.seed + rnd)
        for mode in modes:
            results, plan, deadlines, duration, load = await serve_mode(args, mode, mix, stamp, report, plan,
                                                                        deadlines)
            runs[mode].append((results, plan, duration, load))
            report["modes"][mode] = pooled_summary(runs[mode], deadlines, mix)
            out.write_text(json.dumps(report, indent=1))  # after every mode: a run cut short keeps what it measured
    base = report["modes"]["request-fcfs"]
    for mode, m in report["modes"].items():
        if mode != "request-fcfs":
            m["targets"] = target_checks(base, m, args.min_throughput_ratio)
    report["simulated"] = simulated(report, args, mix)
    out.write_text(json.dumps(report, indent=1))
    print_table(report)
    plot_cdf(report, out.with_suffix(".png"))
    print(f"wrote {out}")
    return report


async def serve_mode(args: argparse.Namespace, mode: str, mix: list[tuple[str, int]], stamp: str,
                     report: dict[str, Any], plan: list[tuple[float, int]], deadlines: list[float]):
    """One mode's server replays `plan`; with no plan yet (the run's first mode, request FCFS) it first measures
    the solo latencies that set the plan and deadlines. (results, plan, deadlines, duration, 1-min loadavg
    before and after)."""
    server = Server(args.compare_modes, _free_port(), mode_flags(args, mode),
                    Path(tempfile.gettempdir()) / f"serving_modes-{stamp}-{mode}.log")
    try:
        server.wait_ready()
        async with httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=None)) as client:
            if not plan:
                rate, deadlines = await calibrate(client, args, mix, report)
                plan = poisson_plan(rate, args.num_prompts, len(mix), args.seed)
            else:
                await solo_latencies(client, args, mix, 0)  # the same warm-up as the first mode had
            load_before = os.getloadavg()[0]
            results, duration = await replay(client, args, plan, mix, deadlines)
    finally:
        server.close()
    return results, plan, deadlines, duration, [load_before, os.getloadavg()[0]]


def mode_flags(args: argparse.Namespace, mode: str) -> list[str]:
    """The `vllm serve` flags of `mode`: every mode gets the same --max-num-seqs (request mode co-batches
    compatible requests too), so the modes differ in how they schedule only."""
    extra = shlex.split(args.server_args)
    warmup = [] if "--diffusion-warmup-shapes" in extra else [
        "--diffusion-warmup-shapes", ",".join(dict.fromkeys(size for size, _ in parse_mix(args.mix)))]
    return [*MODES[mode], "--max-num-seqs", str(args.max_num_seqs), *warmup, *extra]


def pooled_summary(runs: list[tuple[list[RequestResult], list[tuple[float, int]], float, list[float]]],
                   deadlines: list[float], mix: list[tuple[str, int]]) -> dict[str, Any]:
    """`mode_summary` over every round of a mode (throughput = all completed / all replay time), with each round's
    own summary under "rounds"."""
    results = [r for run in runs for r in run[0]]
    plan = [p for run in runs for p in run[1]]
    summary = mode_summary(results, plan, deadlines, sum(run[2] for run in runs), mix)
    summary["loadavg_1m"] = [runs[0][3][0], runs[-1][3][1]]
    summary["rounds"] = [{**mode_summary(r, p, deadlines, d), "loadavg_1m": load} for r, p, d, load in runs]
    return summary


async def calibrate(client: httpx.AsyncClient, args: argparse.Namespace, mix: list[tuple[str, int]],
                    report: dict[str, Any]) -> tuple[float, list[float]]:
    """Solo latency per class (median of `--calibration-reps` on the idle request-mode server) and the offered
    rate (`--request-rate`, else `--load` / the mix's mean solo time: requests are drawn uniformly from the mix);
    deadline = 2x the class's solo latency."""
    solo = await solo_latencies(client, args, mix, args.calibration_reps)
    capacity = await measured_capacity(client, args, mix)
    rate = args.request_rate if args.request_rate != float("inf") else args.load * capacity
    report.update(solo_latency_s={f"{size}:{steps}": t for (size, steps), t in zip(mix, solo, strict=True)},
                  request_rate=rate, measured_capacity_rps=capacity, solo_capacity_rps=1.0 / float(np.mean(solo)),
                  offered_load=rate / capacity)
    return rate, [2.0 * t for t in solo]


async def measured_capacity(client: httpx.AsyncClient, args: argparse.Namespace, mix: list[tuple[str, int]]
                            ) -> float:
    """Requests/s the idle request-mode server sustains over `--calibration-burst` requests with `--max-num-seqs`
    of them in flight, each next one's class drawn at random from the mix (seeded). A burst sent at once let
    request mode co-batch same-shape requests `--max-num-seqs` at a time, which Poisson arrivals of a mixed plan
    rarely allow: on the H100 its 0.558/s was above what either mode then served (0.365 / 0.390/s at "load 0.8")."""
    n = args.calibration_burst or 4 * args.max_num_seqs * len(mix)
    rng = random.Random(args.seed - 1)
    pending = iter(enumerate([rng.randrange(len(mix)) for _ in range(n)]))

    async def lane() -> None:
        for i, cls in pending:
            result = await send_one(client, body(args, i, *mix[cls], None), args.timeout)
            if not result.ok:
                raise RuntimeError(f"calibration request failed: {result.error}")

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(args.max_num_seqs)))
    return n / (time.perf_counter() - start)


def simulated(report: dict[str, Any], args: argparse.Namespace, mix: list[tuple[str, int]]) -> dict[str, Any]:
    """`sim_step_policies.py` on this run's mix, rate and slots: step seconds per size from the measured solo
    latencies (two step counts of a size: the slope; one: latency / steps), the rest as fixed per-request cost;
    co-batching assumed to gain nothing. Ratios against request FCFS, mean over seeds."""
    import sim_step_policies

    solo = report["solo_latency_s"]
    step, fixed = {}, {}
    for size in sorted({size for size, _ in mix}):
        points = sorted((steps, solo[f"{size}:{steps}"]) for s2, steps in mix if s2 == size)
        (n0, t0), (n1, t1) = points[0], points[-1]
        step[size] = (t1 - t0) / (n1 - n0) if n1 > n0 else t0 / n0
        fixed[size] = max(t0 - n0 * step[size], 0.0)
    per = lambda d: ",".join(f"{k}={v:.5f}" for k, v in d.items())  # noqa: E731
    sim_load = report["request_rate"] * float(np.mean(list(solo.values())))
    argv = ["--mix", ",".join(f"{size}:{steps}" for size, steps in mix), "--step-seconds", per(step),
            "--encode-seconds", per(fixed), "--decode-seconds", per(dict.fromkeys(step, 0.0)),
            "--batch-speedup", per(dict.fromkeys(step, 1.0)), "--num-prompts", str(args.num_prompts),
            "--load", f"{sim_load:.4f}", "--seeds", "50", "--slots", str(args.max_num_seqs),
            "--starvation-factors", "4", "--admission-floors", "0.9",
            "--only", "^(step-fcfs|slo, starvation 4|slo \\+ admission control, floor 0.9)$"]
    rows = sim_step_policies.table(sim_step_policies.parse_args(argv))
    names = {"request-fcfs": "request-fcfs", "step-fcfs": "step-fcfs", "slo, starvation 4": "step-slo",
             "slo + admission control, floor 0.9": "step-slo-admit"}
    return {"argv": argv, "modes": {names[name]: {"mean_over_request_fcfs": float(r[:, 5].mean()),
                                                  "p95_over_request_fcfs": float(r[:, 6].mean()),
                                                  "attainment": float(r[:, 2].mean()),
                                                  "throughput_over_request_fcfs": float(r[:, 8].mean())}
                                    for name, r in rows.items() if name in names}}


def poisson_plan(rate: float, n: int, classes: int, seed: int) -> list[tuple[float, int]]:
    """The seeded Poisson (gap, class) schedule every mode of a round replays."""
    rng = random.Random(seed)
    return [(rng.expovariate(rate), rng.randrange(classes)) for _ in range(n)]


def print_table(report: dict[str, Any]) -> None:
    base = report["modes"]["request-fcfs"]
    print(f"solo latency per class (s): {json.dumps(report['solo_latency_s'])}; rate {report['request_rate']:.3f}/s "
          f"(offered load {report['offered_load']:.2f} of the measured request-mode capacity "
          f"{report['measured_capacity_rps']:.3f}/s; from solo latency {report['solo_capacity_rps']:.3f}/s)")
    print(f"{'mode':<14}{'ok':>4}{'mean s':>9}{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}{'req/s':>8}{'attain':>8}"
          f"{'mean/req':>10}{'p95/req':>9}{'tput/req':>10}{'load1m':>12}")
    for mode, m in report["modes"].items():
        print(f"{mode:<14}{m['completed']:>4}{m['latency_mean_s']:>9.3f}{m['latency_p50_s']:>8.3f}"
              f"{m['latency_p95_s']:>8.3f}{m['latency_p99_s']:>8.3f}{m['throughput_rps']:>8.3f}"
              f"{m['deadline_attainment']:>8.1%}{m['latency_mean_s'] / base['latency_mean_s']:>10.2f}"
              f"{m['latency_p95_s'] / base['latency_p95_s']:>9.2f}"
              f"{m['throughput_rps'] / base['throughput_rps']:>10.2f}"
              f"{m['loadavg_1m'][0]:>6.1f}-{m['loadavg_1m'][1]:<5.1f}")
    print("per class: mean s / p95 s / attainment")
    for mode, m in report["modes"].items():
        cells = [f"{name} {c['latency_mean_s'] or float('nan'):.2f}/{c['latency_p95_s'] or float('nan'):.2f}/"
                 f"{c['deadline_attainment']:.0%}" for name, c in m["per_class"].items()]
        print(f"  {mode:<14}" + "  ".join(cells))
    if len(base["rounds"]) > 1:
        print("per round (mean/req, p95/req, attainment; request-fcfs attainment):")
        for rnd, b in enumerate(base["rounds"]):
            cells = [f"{mode} {m['rounds'][rnd]['latency_mean_s'] / b['latency_mean_s']:.2f}/"
                     f"{m['rounds'][rnd]['latency_p95_s'] / b['latency_p95_s']:.2f}/"
                     f"{m['rounds'][rnd]['deadline_attainment']:.0%}" for mode, m in report["modes"].items()
                     if mode != "request-fcfs" and rnd < len(m["rounds"])]
            print(f"  round {rnd}: " + "  ".join(cells) + f"; request-fcfs {b['deadline_attainment']:.0%}")
    sim = report.get("simulated", {}).get("modes", {})
    for mode, m in report["modes"].items():
        if mode in sim and mode != "request-fcfs":
            p = sim[mode]
            print(f"{mode}: measured mean/req {m['latency_mean_s'] / base['latency_mean_s']:.2f}, p95/req "
                  f"{m['latency_p95_s'] / base['latency_p95_s']:.2f}, throughput/req "
                  f"{m['throughput_rps'] / base['throughput_rps']:.2f}; simulated {p['mean_over_request_fcfs']:.2f}, "
                  f"{p['p95_over_request_fcfs']:.2f}, {p['throughput_over_request_fcfs']:.2f}")
    for mode, m in report["modes"].items():
        if "targets" in m:
            print(f"targets {mode} vs request-fcfs: "
                  + ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in m["targets"].items()))


def plot_cdf(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no latency CDF plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, m in report["modes"].items():
        lat = np.sort(m["latencies_s"])
        ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=mode)
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Diffusion serving: latency CDF per execution mode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8091")
    parser.add_argument("--model", default=None, help="model name sent in the body (default: the server's)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests (per mode); default 16, "
                        "compare-modes 40")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s; inf = all at once (compare-modes: inf = --load x measured capacity)")
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
    parser.add_argument("--compare-modes", metavar="MODEL", default=None,
                        help="start a server per execution mode on MODEL and compare them")
    parser.add_argument("--mix", default="128x128:8,128x128:24,256x256:12",
                        help="compare-modes: request classes SIZE:STEPS, drawn uniformly")
    parser.add_argument("--load", type=float, default=0.8, help="compare-modes: offered load / measured capacity")
    parser.add_argument("--max-num-seqs", "--step-max-num-seqs", dest="max_num_seqs", type=int, default=2,
                        help="compare-modes: --max-num-seqs of every mode (request mode: requests co-batched per "
                        "forward; step modes: resident states / co-batch size); the old name still works")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="compare-modes: which modes, request-fcfs first (it calibrates the load)")
    parser.add_argument("--min-throughput-ratio", type=float, default=0.98,
                        help="compare-modes: throughput target of a step mode / request-fcfs (1.3 for the 256^2 run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="compare-modes: run the modes this many times in turn (round r replays the Poisson plan "
                        "of seed --seed + r), pooled in the table, each round's ratios listed")
    parser.add_argument("--smoke", action="store_true",
                        help="compare-modes: 3 prompts per mode, no calibration reps (checks the script path)")
    parser.add_argument("--server-args", default="", help="compare-modes: more `vllm serve` flags, e.g. "
                        "'--load-format dummy --no-enforce-eager'")
    parser.add_argument("--calibration-burst", type=int, default=0,
                        help="compare-modes: requests (random classes, --max-num-seqs in flight) that measure "
                             "request-mode capacity (0: 4 x --max-num-seqs x classes)")
    parser.add_argument("--calibration-reps", type=int, default=3,
                        help="compare-modes: solo requests per class after its warm-up (the median is used)")
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 40 if args.compare_modes else 16
    if args.smoke:
        args.num_prompts, args.calibration_reps = 3, 0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.compare_modes:
        return asyncio.run(compare_modes(args))
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
