"""Start-up and shutdown phases a user waits for: `vllm serve tiny/qwen-image --omni`, `vllm serve tiny/qwen3-omni
--omni` (3 stages), `Omni("tiny/qwen2")` and `Omni("tiny/qwen-image")`, each in a fresh process as a user starts it
(issue 30).

For a server: seconds from the spawn to each start-up log line that marks a phase (the first log line, after the
imports; weights loaded; vLLM's warm-up; the first EngineCore ready; each stage ready; all stages ready; HTTP up),
to `/health` answering 200 (ready), then SIGTERM on the idle server to its exit. For `Omni(...)`: its import,
construction and `close()`, timed inside the process, and the process's whole life; the reference is vLLM's own
`AsyncLLM` on the same checkpoint. The 1-minute load average before and after each run is kept: on a shared
machine it decides the numbers. Writes benchmarks/results/bench_startup-<UTC>.json and a PNG (ready and stop
seconds per target, with the issue's targets).

    .venv/bin/python benchmarks/startup/bench_startup.py [--rounds 2] [--only serve-qwen-image]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
VLLM = str(Path(sys.executable).with_name("vllm"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
TIMEOUT_S = 600.0

MARKERS = {
    "first_log": re.compile(r"\bINFO\b|\bWARNING\b"),
    "first_engine_core_ready": re.compile(r"\[StageRuntime\] .* ready in .*EngineCore \S+ s"),
    "weights_loaded": re.compile(r"Loading weights took|\[diffusion rank \d+\] loaded "),
    "vllm_warmup_done": re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    "first_stage_ready": re.compile(r"\[StageRuntime\] .* ready in"),
    "all_stages_ready": re.compile(r"\[AsyncOmniEngine\] \d+ stage\(s\) .* ready in"),
    "http_up": re.compile(r"Application startup complete"),
}
"""Start-up log lines that mark a phase; a phase's time is when its first line appeared, from the spawn."""
STAGE_READY = re.compile(r"\[StageRuntime\] (\S+) ready in (\S+) s(?: \((.*)\))?")
"""Each stage's own start-up line: its total and its phases (`name seconds s`, comma-separated)."""


def stage_phases(log: str) -> dict[str, dict[str, float]]:
    """Per stage, the seconds of its start and of each phase its start-up line names."""
    out = {}
    for name, total, phases in STAGE_READY.findall(log):
        out[name] = {"total": float(total)}
        for part in filter(None, phases.split(", ")):
            phase, seconds = part.rsplit(" ", 2)[:2]
            out[name][phase] = float(seconds)
    return out

TARGETS = {"serve-qwen-image": {"ready_s": 8.0, "sigterm_exit_s": 3.0},
           "serve-qwen3-omni": {"ready_s": 15.0, "sigterm_exit_s": 3.0},
           "omni-qwen2": {"ready_s": 8.0, "close_s": 1.5},
           "omni-qwen-image": {"ready_s": 8.0, "close_s": 1.5},
           "omni-qwen2-eager": {"ready_s": 8.0, "close_s": 1.5},
           "vllm-asyncllm-qwen2-eager": {"ready_s": 8.0, "close_s": 1.5}}
"""Issue 30's targets, on 2 cores of a quiet machine."""

SERVE = {"serve-qwen-image": ["tiny/qwen-image"],
         "serve-qwen3-omni": ["tiny/qwen3-omni"]}
OMNI = ("omni-qwen2", "omni-qwen2-eager", "omni-qwen-image", "vllm-asyncllm-qwen2-eager")
"""`omni-qwen-image` is the one-stage diffusion start without the HTTP server (the issue sets no target of its own:
the server's are shown). `vllm-asyncllm-qwen2-eager` is the reference: vLLM's own `AsyncLLM` for the same checkpoint
and engine arguments (vLLM forks its EngineCore where the caller chose no start method; our front end spawns it)."""

OMNI_SCRIPT = """
import sys
import time
EXTRA = {"enforce_eager": True} if "eager" in sys.argv[1:] else {}
t0 = time.perf_counter()
if "vllm" in sys.argv[1:]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm_omni.catalog.tiny import resolve_model
else:
    from vllm_omni import Omni
t1 = time.perf_counter()
if __name__ == "__main__":
    if "vllm" in sys.argv[1:]:
        engine_args = AsyncEngineArgs(model=resolve_model("tiny/qwen2"), gpu_memory_utilization=0.15,
                                      max_model_len=256, **EXTRA)
        stop = AsyncLLM.from_engine_args(engine_args).shutdown
    elif "image" in sys.argv[1:]:
        stop = Omni("tiny/qwen-image").close
    else:
        stop = Omni("tiny/qwen2", gpu_memory_utilization=0.15, max_model_len=256, **EXTRA).close
    t2 = time.perf_counter()
    stop()
    t3 = time.perf_counter()
    print(f"BENCH import_s={t1 - t0:.3f} start_s={t2 - t1:.3f} close_s={t3 - t2:.3f}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load1() -> float:
    return os.getloadavg()[0]


def _read_phases(proc: subprocess.Popen, start: float, phases: dict[str, float], log: list[str]) -> None:
    for line in proc.stdout:
        log.append(line)
        for name, pattern in MARKERS.items():
            if name not in phases and pattern.search(line):
                phases[name] = round(time.monotonic() - start, 2)


def bench_serve(name: str, args: list[str]) -> dict:
    port = free_port()
    load_before = load1()
    start = time.monotonic()
    proc = subprocess.Popen([VLLM, "serve", *args, "--omni", "--host", "127.0.0.1", "--port", str(port)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    phases: dict[str, float] = {}
    log: list[str] = []
    reader = threading.Thread(target=_read_phases, args=(proc, start, phases, log), daemon=True)
    reader.start()
    try:
        while time.monotonic() - start < TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: server exited {proc.returncode}:\n{''.join(log[-40:])}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{name}: not ready within {TIMEOUT_S:.0f} s")
        ready_s = time.monotonic() - start
        time.sleep(1.0)  # idle
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        exit_s = time.monotonic() - stop
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    reader.join(timeout=10)
    left = _group_left(proc.pid)
    return {"target": name, "ready_s": round(ready_s, 2), "sigterm_exit_s": round(exit_s, 2), "phases_s": phases,
            "stages_s": stage_phases("".join(log)),
            "exit_code": proc.returncode, "processes_left": left, "load1_before": load_before,
            "load1_after": load1()}


def _group_left(pgid: int) -> list[str]:
    """The server's process group once the server has exited: its command lines (empty when nothing is left)."""
    out = subprocess.run(["pgrep", "-a", "-g", str(pgid)], capture_output=True, text=True)
    return [line[:200] for line in out.stdout.splitlines()]


def bench_omni(target: str) -> dict:
    """`Omni("tiny/qwen2")` as given (vLLM's CPU default compiles the model), or with `enforce_eager=True`; or the
    reference, vLLM's `AsyncLLM`."""
    load_before = load1()
    start = time.monotonic()
    extra = ((["eager"] if target.endswith("-eager") else []) + (["vllm"] if target.startswith("vllm-") else [])
             + (["image"] if target == "omni-qwen-image" else []))
    out = subprocess.run([sys.executable, "-c", OMNI_SCRIPT, *extra], env=ENV, capture_output=True, text=True,
                         timeout=TIMEOUT_S, cwd=ROOT)
    total_s = time.monotonic() - start
    found = re.search(r"BENCH import_s=(\S+) start_s=(\S+) close_s=(\S+)", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"Omni run failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    import_s, start_s, close_s = map(float, found.groups())
    stage = re.search(r"\(vLLM config (\S+) s, EngineCore (\S+) s\)", out.stdout + out.stderr)
    warm = re.search(r"init engine \(profile, create kv cache, warmup model\) took (\S+) s", out.stdout + out.stderr)
    phases = {"import_s": import_s, "vllm_config_s": float(stage.group(1)) if stage else None,
              "engine_core_ready_s": float(stage.group(2)) if stage else None,
              "vllm_warmup_s": float(warm.group(1)) if warm else None}
    return {"target": target, "ready_s": round(import_s + start_s, 2), "start_s": start_s, "close_s": close_s,
            "stages_s": stage_phases(out.stdout + out.stderr),
            "process_s": round(total_s, 2), "phases_s": phases, "load1_before": load_before, "load1_after": load1()}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for target in dict.fromkeys(r["target"] for r in runs):
        mine = [r for r in runs if r["target"] == target]
        keys = [k for k in ("ready_s", "sigterm_exit_s", "close_s", "start_s") if k in mine[0]]
        out[target] = {k: statistics.median(r[k] for r in mine) for k in keys}
        out[target]["targets"] = TARGETS[target]
        out[target]["load1"] = statistics.median(r["load1_before"] for r in mine)
    return out


def print_table(runs: list[dict]) -> None:
    print(f"{'target':18} {'ready s':>8} {'stop s':>7} {'load1':>6}  phases (s from spawn)")
    for r in runs:
        stop = r.get("sigterm_exit_s", r.get("close_s"))
        phases = " ".join(f"{k}={v}" for k, v in r["phases_s"].items() if v is not None)
        print(f"{r['target']:18} {r['ready_s']:8.2f} {stop:7.2f} {r['load1_before']:6.1f}  {phases}")
        for stage, seconds in r.get("stages_s", {}).items():
            print(f"{'':42}{stage}: " + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))


def plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    ready = [summary[n]["ready_s"] for n in names]
    stop = [summary[n].get("sigterm_exit_s", summary[n].get("close_s")) for n in names]
    ax.bar([i - 0.2 for i in x], ready, width=0.4, label="ready (s)")
    ax.bar([i + 0.2 for i in x], stop, width=0.4, label="stop: SIGTERM to exit / close() (s)")
    for i, n in enumerate(names):
        t = summary[n]["targets"]
        ax.hlines(t["ready_s"], i - 0.4, i, colors="k", linestyles="--")
        ax.hlines(t.get("sigterm_exit_s", t.get("close_s")), i, i + 0.4, colors="k", linestyles="--")
    ax.set_xticks(list(x), [f"{n}\n(load {summary[n]['load1']:.1f})" for n in names])
    ax.set_ylabel("seconds (median)")
    ax.set_title("Start-up and stop, 2-core CPU (dashed: issue 30 targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="Runs of each target (medians are reported).")
    parser.add_argument("--only", action="append", choices=[*SERVE, *OMNI],
                        help="Run only this target (repeatable).")
    args = parser.parse_args()
    targets = args.only or [*SERVE, *OMNI]
    runs = []
    for round_id in range(args.rounds):
        for target in targets:
            run = bench_omni(target) if target in OMNI else bench_serve(target, SERVE[target])
            run["round"] = round_id
            runs.append(run)
            print(json.dumps(run), flush=True)
    print_table(runs)
    summary = summarize(runs)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"bench_startup-{stamp}.json"
    out.write_text(json.dumps({"cpus": os.cpu_count(), "summary": summary, "runs": runs}, indent=2))
    plot(out.with_suffix(".png"), summary)
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
