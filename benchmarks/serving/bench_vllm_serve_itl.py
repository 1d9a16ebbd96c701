"""`vllm bench serve` (vLLM's own client) against plain `vllm serve` and `vllm serve ... --omni` on the same tiny
model, in one run: request throughput, mean ITL and mean TPOT side by side (issue 18's acceptance: throughput
>= 0.98x plain vLLM's, mean ITL <= 1.1x).

Workload: openai-chat backend on /v1/chat/completions, random dataset (32-token prompts, 16 output tokens,
ignore_eos), concurrency 8, 200 prompts per server. On a shared, noisy machine one server after the other
compares two load levels, not two servers: both servers stay up (idle between their turns) and take short
rounds in turn, ABBA order (plain, omni, omni, plain, ...: a load trend hits both alike), 4 rounds of 50 prompts
by default, the same prompts for both servers within a round. Reported: each round's omni / plain ratios, their
median (the verdict), the 1-minute load average around each run, and each server's CPU time per request (its
process group: API server + EngineCore; and the API-server process alone), which other jobs on the machine
distort less than latencies. Prints a table and writes benchmarks/results/bench_vllm_serve_itl-<UTC>.json and
a PNG chart next to it.

    .venv/bin/python benchmarks/serving/bench_vllm_serve_itl.py [--rounds 4] [--num-prompts 200] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny/qwen2"
SERVER_FLAGS = ["--gpu-memory-utilization", "0.15", "--max-model-len", "512", "--max-num-seqs", "8",
                "--enforce-eager"]
METRICS = ("request_throughput", "mean_itl_ms", "mean_tpot_ms", "mean_ttft_ms", "server_cpu_ms_per_request",
           "api_cpu_ms_per_request")
CPU_METRICS = ("server_cpu_ms_per_request", "api_cpu_ms_per_request")
"""Measured here, not by `vllm bench serve`: the server's whole process group, and its API-server process alone
(for `--omni` also its orchestrator thread; the rest is the EngineCore)."""
TARGETS = {"request_throughput": (">=", 0.98), "mean_itl_ms": ("<=", 1.1)}
"""Issue 18's acceptance, on the median of the per-round omni / plain ratios."""
STARTUP_TIMEOUT_S = 600.0
VLLM = str(Path(sys.executable).with_name("vllm"))


class Server:
    """`vllm serve` in its own process group, on a free port; `omni` adds `--omni`."""

    def __init__(self, model_path: str, omni: bool, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        model = MODEL if omni else model_path  # plain vLLM gets the checkpoint directory itself
        cmd = [VLLM, "serve", model, *(["--omni"] if omni else []), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), *SERVER_FLAGS]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        self._log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.close()
        raise TimeoutError(f"{' '.join(cmd)} not ready in {STARTUP_TIMEOUT_S:.0f} s; see {log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


def cpu_seconds(pgid: int) -> tuple[float, float]:
    """User + system CPU seconds of the live processes of process group `pgid` (a server and its EngineCore),
    and of its leader (the API server) alone."""
    total = leader = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on: see proc(5)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
            if stat.parent.name == str(pgid):
                leader = int(fields[11]) + int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return total / tick, leader / tick


def bench(server: Server, tokenizer: str, args: argparse.Namespace, out_dir: Path, name: str, seed: int) -> dict:
    """One `vllm bench serve` run of `args.num_prompts // args.rounds` prompts: its metrics, the server's CPU
    time per request (what a loaded machine's scheduler cannot distort much) and the 1-min load average before
    and after it."""
    num_prompts = args.num_prompts // args.rounds
    cmd = [VLLM, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", server.url, "--model", MODEL, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
           "--num-warmups", str(args.concurrency), "--disable-tqdm", "--seed", str(seed), "--save-result",
           "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    load_before, cpu_before = os.getloadavg()[0], cpu_seconds(server.proc.pid)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads((out_dir / f"{name}.json").read_text())
    if result["completed"] != num_prompts:
        raise RuntimeError(f"{name}: {result['completed']} of {num_prompts} requests completed")
    requests = num_prompts + args.concurrency  # + warm-ups
    cpu_ms = [(after - before) * 1000 / requests for after, before in zip(cpu_seconds(server.proc.pid), cpu_before,
                                                                           strict=True)]
    return {**{key: result[key] for key in METRICS if key not in CPU_METRICS},
            **dict(zip(CPU_METRICS, cpu_ms, strict=True)), "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def run_rounds(servers: dict[str, Server], tokenizer: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    """ABBA rounds: plain first in even rounds, omni first in odd ones."""
    rounds = []
    for i in range(args.rounds):
        order = ("plain", "omni") if i % 2 == 0 else ("omni", "plain")
        results = {name: bench(servers[name], tokenizer, args, out_dir, f"{name}-{i}", seed=i) for name in order}
        ratios = {key: results["omni"][key] / results["plain"][key] for key in METRICS}
        rounds.append({"round": i, "order": order, **results, "ratios": ratios})
        print(f"round {i} ({' -> '.join(order)}): " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
              + f"; load {results[order[0]]['load_before']:.1f} -> {results[order[1]]['load_after']:.1f}", flush=True)
    return rounds


def summarize(rounds: list[dict]) -> dict:
    medians = {key: statistics.median(r["ratios"][key] for r in rounds) for key in METRICS}
    verdict = {key: (medians[key] >= bound if op == ">=" else medians[key] <= bound)
               for key, (op, bound) in TARGETS.items()}
    means = {name: {key: statistics.fmean(r[name][key] for r in rounds) for key in METRICS}
             for name in ("plain", "omni")}
    loads = [r[name][when] for r in rounds for name in ("plain", "omni") for when in ("load_before", "load_after")]
    return {"median_ratios": medians, "met": verdict, "mean_over_rounds": means,
            "load_avg_1m": {"min": min(loads), "max": max(loads), "median": statistics.median(loads)}}


def print_table(rounds: list[dict], summary: dict) -> None:
    print(f"{'metric':<20}" + "".join(f"{'round ' + str(r['round']):>10}" for r in rounds) + f"{'median':>10}")
    for key in METRICS:
        print(f"{key:<20}" + "".join(f"{r['ratios'][key]:>10.3f}" for r in rounds)
              + f"{summary['median_ratios'][key]:>10.3f}")
    for key, (op, bound) in TARGETS.items():
        print(f"target {key} ratio {op} {bound}: {'met' if summary['met'][key] else 'NOT met'}")
    load = summary["load_avg_1m"]
    print(f"load average (1 min) during the runs: {load['min']:.1f}-{load['max']:.1f}, median {load['median']:.1f}")


def plot(path: Path, rounds: list[dict], summary: dict) -> None:
    """Per metric: a bar from 1.0x to the median omni / plain ratio and a dot per round, on a log scale (noisy
    rounds are off by 10x and more). PIL: the benchmark needs no plotting library."""
    import math

    from PIL import Image, ImageDraw

    width, height, margin = 640, 360, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    values = [r["ratios"][key] for r in rounds for key in METRICS]
    low, high = math.log(min(0.5, *values)), math.log(max(2.0, *values))

    def y(ratio: float) -> float:
        return height - margin - (height - 2 * margin) * (math.log(ratio) - low) / (high - low)

    for ratio in (0.1, 0.5, 1.0, 2.0, 10.0, 100.0):
        if low <= math.log(ratio) <= high:
            draw.line([(margin, y(ratio)), (width - 20, y(ratio))], fill="black" if ratio == 1.0 else "lightgray")
            draw.text((5, y(ratio) - 6), f"{ratio:g}x", fill="gray")
    slot = (width - margin - 20) / len(METRICS)
    for i, key in enumerate(METRICS):
        x0 = margin + i * slot + slot * 0.2
        median = summary["median_ratios"][key]
        draw.rectangle([x0, min(y(median), y(1.0)), x0 + slot * 0.6, max(y(median), y(1.0))], fill="steelblue")
        for j, r in enumerate(rounds):
            cx, cy = x0 + slot * 0.6 * (j + 1) / (len(rounds) + 1), y(r["ratios"][key])
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill="orange", outline="black")
        draw.text((x0, height - margin + 8), key.removeprefix("mean_").removesuffix("_ms")[:16], fill="black")
        draw.text((x0 + slot * 0.62, y(median) - 6), f"{median:.2f}x", fill="black")
    draw.text((margin, 10), f"vllm serve --omni / plain vllm serve, {len(rounds)} interleaved rounds "
              "(log scale; bar: median, dots: rounds)", fill="black")
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=200, help="per server, over all rounds")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from vllm_omni.catalog.tiny import resolve_model

    model_path = resolve_model(MODEL)
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, omni in (("plain", False), ("omni", True)):
                servers[name] = Server(model_path, omni, Path(tmp) / f"{name}.log")
            rounds = run_rounds(servers, model_path, args, Path(tmp))
        finally:
            for server in servers.values():
                server.close()
    summary = summarize(rounds)
    print_table(rounds, summary)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"bench_vllm_serve_itl-{stamp}.json"
    out.write_text(json.dumps({"workload": vars(args), "model": MODEL, "rounds": rounds, **summary,
                               "machine": platform.platform(), "cpus": os.cpu_count()}, indent=2))
    plot(out.with_suffix(".png"), rounds, summary)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
