"""How long a `vllm serve ... --omni` diffusion stage is without a worker after `kill -9` of it: seconds from the
kill to the first image request answered 200 again, for several kills in a row of one server (issue 30).

A restart runs in a core whose engine threads run, where fork is unsafe: the replacement comes from the core's
forkserver (vllm_omni/diffusion/process_start.py), which pays the worker's imports at the first restart, or, on
trees before it, from a spawn, which pays them at every restart. Each kill waits until the server answered again;
the request sent meanwhile is retried every 0.1 s (a 503 while the stage restarts). Writes
benchmarks/results/bench_worker_restart-<label>-<UTC>.json and a PNG (seconds per kill).

    .venv/bin/python benchmarks/startup/bench_worker_restart.py [--kills 3] [--label main]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
VLLM = str(Path(sys.executable).with_name("vllm"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
BODY = {"prompt": "a red cube", "size": "32x32", "num_inference_steps": 2, "seed": 0}
TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_helper(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker or forkserver (whose children carry its command line too)."""
    cmdline = " ".join(proc.cmdline())
    if "resource_tracker" in cmdline:
        return True
    return "multiprocessing.forkserver" in cmdline and "multiprocessing.forkserver" not in " ".join(
        proc.parent().cmdline())


def worker(server: psutil.Process) -> psutil.Process:
    """The stage's one live worker: a process its core started (forked, from the core's forkserver or spawned)."""
    for proc in server.children(recursive=True):
        try:
            parent = proc.parent()
            starter = parent.parent() if is_helper(parent) else parent
            if not is_helper(proc) and starter.pid != server.pid and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError("no worker found")


def answered(url: str) -> bool:
    try:
        return httpx.post(url, json=BODY, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def run(model: str, kills: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/images/generations"
    proc = subprocess.Popen([VLLM, "serve", model, "--omni", "--host", "127.0.0.1", "--port", str(port)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not answered(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready (exit code {proc.returncode})")
            time.sleep(0.2)
        server = psutil.Process(proc.pid)
        seconds = []
        for i in range(kills):
            victim = worker(server)
            killed_at = time.monotonic()
            victim.kill()
            while not answered(url):
                if time.monotonic() - killed_at > TIMEOUT_S:
                    raise RuntimeError(f"kill {i + 1}: no answer within {TIMEOUT_S:.0f} s")
                time.sleep(0.1)
            seconds.append(round(time.monotonic() - killed_at, 2))
            print(f"kill {i + 1}: answered again after {seconds[-1]:.2f} s", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return {"model": model, "seconds_to_answer_after_kill": seconds}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = result["seconds_to_answer_after_kill"]
    ax.bar([f"kill {i + 1}" for i in range(len(values))], values)
    ax.set_ylabel("s from kill -9 to a 200")
    ax.set_title(f"{result['model']} worker restart ({result['label']}, {result['cpus']} CPUs)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny/qwen-image")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--label", default="head", help="names the tree in the result file")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    result = {**run(args.model, args.kills), "label": args.label, "cpus": os.cpu_count(),
              "load1_before": load_before, "load1_after": os.getloadavg()[0]}
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"bench_worker_restart-{args.label}-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print("| kill | s to a 200 |\n|---|---|")
    for i, s in enumerate(result["seconds_to_answer_after_kill"]):
        print(f"| {i + 1} | {s:.2f} |")
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
