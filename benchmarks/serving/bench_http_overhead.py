"""Per-request cost of the HTTP server over the offline `AsyncOmni` path, side by side in one run.

For each workload the script first serves the model with `vllm serve MODEL --omni` in a subprocess and times
HTTP requests, then shuts it down and times the same requests through an `AsyncOmni` in this process (one
engine at a time: two idle vLLM engines on 2 cores slow each other down). Workloads (issue #5):
  image  /v1/images/generations on tiny/qwen-image, 64x64, 4 steps, seed 0 (includes PNG + base64 encoding)
  chat   /v1/chat/completions on tiny/qwen2, 16 tokens (ignore_eos), greedy
Two overhead figures:
  paired    (sum of HTTP client latencies - sum of the engine's own e2e for those same requests, read from the
            server's /metrics) / N: what the HTTP layer adds per request, immune to engine-speed noise
  vs offline  median(HTTP) - median(offline AsyncOmni): the whole server path against the Python API
(on a shared, loaded machine the second one is dominated by noise; the first one is the honest number).
Prints a table and writes benchmarks/results/bench_http_overhead-<UTC>.json.

    .venv/bin/python benchmarks/serving/bench_http_overhead.py [--iters 20] [--workloads image chat]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
AR_FLAGS = {"gpu_memory_utilization": 0.15, "max_model_len": 512, "enforce_eager": True}
WORKLOADS = {
    "image": {"model": "tiny/qwen-image", "engine_kwargs": {}},
    "chat": {"model": "tiny/qwen2", "engine_kwargs": AR_FLAGS},
}
PROMPT = "a lighthouse on a cliff at dusk"


def _flags(kwargs: dict) -> list[str]:
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


class Server:
    def __init__(self, model: str, engine_kwargs: dict) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm), "serve", model, "--omni", "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log", *_flags(engine_kwargs)]
        self.log = open(f"/tmp/bench_http_overhead_{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready; see {self.log.name}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


def _requests(name: str, engine):
    """(http path, http body, offline prompt, offline params) for one workload (prompt None without engine)."""
    if name == "image":
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 4, "seed": 0}
        params = [OmniDiffusionSamplingParams(width=64, height=64, num_inference_steps=4, seed=0)]
        return "/v1/images/generations", body, {"prompt": PROMPT}, params
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    prompt = None if engine is None else engine.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0,
                             output_kind=RequestOutputKind.FINAL_ONLY)]
    return "/v1/chat/completions", body, prompt, params


async def _offline_once(engine, prompt, params, request_id: str) -> float:
    start = time.perf_counter()
    async for _ in engine.generate(prompt, request_id, params):
        pass
    return time.perf_counter() - start


async def _http_once(client: httpx.AsyncClient, path: str, body: dict) -> float:
    start = time.perf_counter()
    resp = await client.post(path, json=body)
    elapsed = time.perf_counter() - start
    resp.raise_for_status()
    return elapsed


def _e2e_sum(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm_omni:stage_duration_seconds_sum{") and 'stage="e2e"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("the engine reported no e2e stage duration")


async def run_workload(name: str, iters: int, warmup: int) -> dict:
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    spec = WORKLOADS[name]
    server = Server(spec["model"], spec["engine_kwargs"])
    try:
        server.wait_ready()
        path, body, _, _ = _requests(name, None)
        http = []
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            for _ in range(warmup):
                await _http_once(client, path, body)
            e2e_before = _e2e_sum(server.url)
            for _ in range(iters):
                http.append(await _http_once(client, path, body))
            e2e = _e2e_sum(server.url) - e2e_before
    finally:
        server.close()
    engine = AsyncOmni(spec["model"], **spec["engine_kwargs"])
    try:
        _, _, prompt, params = _requests(name, engine)
        offline = [await _offline_once(engine, prompt, params, f"bench-{name}-{i}") for i in range(warmup + iters)]
        offline = offline[warmup:]
    finally:
        engine.close()
    med_http, med_off = statistics.median(http), statistics.median(offline)
    return {"workload": name, "model": spec["model"], "iters": iters, "http_median_ms": med_http * 1e3,
            "offline_median_ms": med_off * 1e3, "http_min_ms": min(http) * 1e3, "offline_min_ms": min(offline) * 1e3,
            "paired_overhead_ms": (sum(http) - e2e) / iters * 1e3, "vs_offline_ms": (med_http - med_off) * 1e3,
            "http_ms": [t * 1e3 for t in http], "offline_ms": [t * 1e3 for t in offline]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["image", "chat"])
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    results = [asyncio.run(run_workload(name, args.iters, args.warmup)) for name in args.workloads]
    print(f"\n{'workload':<8} {'model':<16} {'HTTP med':>9} {'offline med':>12} {'HTTP min':>9} "
          f"{'offline min':>12} {'paired ovh':>11} {'vs offline':>11}   (ms)")
    for r in results:
        print(f"{r['workload']:<8} {r['model']:<16} {r['http_median_ms']:>9.1f} {r['offline_median_ms']:>12.1f} "
              f"{r['http_min_ms']:>9.1f} {r['offline_min_ms']:>12.1f} {r['paired_overhead_ms']:>11.1f} "
              f"{r['vs_offline_ms']:>11.1f}")
    import torch
    import vllm

    out = ROOT / "benchmarks" / "results" / f"bench_http_overhead-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(sys.argv), "results": results, "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
