"""Serving vs offline for one diffusion model, in ONE run: same machine, model, engine flags, prompts, size, steps.

(a) offline: `Omni(model, ...)` generates `--num-prompts` images after warm-up requests (one per distinct prompt);
    images/s over them, then the engine is closed (its device memory is freed before the server starts).
(b) serving: `python -m vllm_omni.entrypoints.cli.main serve MODEL --omni` (what `vllm serve MODEL --omni` runs)
    as a subprocess on a free port with the same engine flags; after /health and the same warm-up the load
    generator of diffusion_benchmark_serving.py sends the same requests with at most `--max-concurrency` in
    flight; then the server is stopped (SIGTERM, SIGKILL of its process group after a timeout).

Prints offline and serving images/s, their ratio, latency mean/p50/p99 and per-stage durations, and writes JSON
(command, versions, hardware, both results) to `--out`, the server's log next to it. `--smoke` runs a tiny
config-only Qwen-Image with `--load-format dummy` on the CPU.

  python3 benchmarks/diffusion/write_config_only_checkpoint.py --model qwen-image --out /tmp/qi
  python3 benchmarks/diffusion/bench_serving_vs_offline.py --model /tmp/qi --load-format dummy --size 1024 \\
      --steps 10 --num-prompts 16 --max-concurrency 4 --no-enforce-eager --out serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import diffusion_benchmark_serving as load_gen  # noqa: E402

SERVER_MODULE = "vllm_omni.entrypoints.cli.main"
SHUTDOWN_TIMEOUT_S = 60.0


def parse_size(text: str) -> tuple[int, int]:
    """`1024` or `1024x768` -> (width, height)."""
    try:
        width, _, height = text.partition("x")
        return int(width), int(height or width)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--size must be N or WxH, got {text!r}") from exc


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags both paths share, as `Omni(...)` keywords."""
    kwargs = dict(load_format=args.load_format, enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs)
    if args.attention_backend:
        kwargs["diffusion_attention_backend"] = args.attention_backend
    return kwargs


def server_flags(args: argparse.Namespace) -> list[str]:
    """The same engine flags on the `serve` command line."""
    flags = ["--load-format", args.load_format, "--max-num-seqs", str(args.max_num_seqs),
             "--enforce-eager" if args.enforce_eager else "--no-enforce-eager"]
    if args.attention_backend:
        flags += ["--diffusion-attention-backend", args.attention_backend]
    return flags


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    width, height = args.size
    return {"width": width, "height": height, "num_inference_steps": args.steps, "seed": args.seed}


def _mean_stages(durations: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for d in durations for name in d})
    return {name: float(np.mean([d[name] for d in durations if name in d])) for name in names}


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_omni import Omni

    prompts = [load_gen.PROMPTS[i % len(load_gen.PROMPTS)] for i in range(max(args.num_prompts, args.warmup))]
    start = time.perf_counter()
    with Omni(args.model, **engine_kwargs(args)) as omni:
        startup = time.perf_counter() - start
        warm = omni.generate(prompts[:args.warmup], sampling_params(args), use_tqdm=False)
        if not all(w.ok for w in warm):
            raise RuntimeError(f"offline warm-up request failed: {[w.error for w in warm if not w.ok]}")
        start = time.perf_counter()
        outputs = omni.generate(prompts[:args.num_prompts], sampling_params(args), use_tqdm=False)
        duration = time.perf_counter() - start
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} offline request(s) failed: {failed[:3]}")
    latencies = np.array([o.stage_durations["e2e"] for o in outputs])
    return {"startup_s": startup, "duration_s": duration, "images": sum(len(o.images) for o in outputs),
            "images_per_s": sum(len(o.images) for o in outputs) / duration,
            "latency_mean_s": float(latencies.mean()), "latency_p50_s": float(np.percentile(latencies, 50)),
            "latency_p99_s": float(np.percentile(latencies, 99)),
            "stage_durations_mean_s": _mean_stages([o.stage_durations for o in outputs])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`serve MODEL --omni` in its own process group; `stop()` leaves no process of it behind."""

    def __init__(self, args: argparse.Namespace, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", SERVER_MODULE, "serve", args.model, "--omni", "--host", "127.0.0.1",
                        "--port", str(self.port), *server_flags(args)]
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float) -> float:
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self._log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy within {timeout:.0f} s; log tail:\n{self._log_tail()}")

    def stop(self) -> bool:
        """SIGTERM, wait, then SIGKILL the whole process group; True when it had exited on SIGTERM."""
        clean = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
                clean = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers the server may have left
        self.proc.wait(timeout=10)
        self._log.close()
        return clean

    def _log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]


def run_serving(args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    server = Server(args, log_path)
    try:
        startup = server.wait_ready(args.startup_timeout)
        width, height = args.size
        gen_args = load_gen.parse_args([
            "--base-url", server.url, "--num-prompts", str(args.num_prompts), "--size", f"{width}x{height}",
            "--num-inference-steps", str(args.steps), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--warmup", str(args.warmup),
            "--timeout", str(args.request_timeout)])
        summary = asyncio.run(load_gen.run(gen_args))
    finally:
        clean = server.stop()
    return {"command": server.command, "startup_s": startup, "clean_shutdown": clean, **summary}


def environment() -> dict[str, Any]:
    import diffusers
    import torch
    import transformers
    import vllm

    import vllm_omni

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "vllm": getattr(vllm, "__version__", "unknown"), "vllm_omni": vllm_omni.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "gpu_count": torch.cuda.device_count() if cuda else 0}


def print_table(offline: dict[str, Any], serving: dict[str, Any]) -> None:
    print(f"{'path':<9}{'img/s':>9}{'mean s':>9}{'p50 s':>9}{'p99 s':>9}{'start s':>9}")
    for name, r in (("offline", offline), ("serving", serving)):
        print(f"{name:<9}{r['images_per_s']:>9.3f}{r['latency_mean_s']:>9.3f}{r['latency_p50_s']:>9.3f}"
              f"{r['latency_p99_s']:>9.3f}{r['startup_s']:>9.1f}")
    print(f"serving / offline images/s: {serving['images_per_s'] / offline['images_per_s']:.3f}")
    stages = sorted(set(offline["stage_durations_mean_s"]) | set(serving["stage_durations_mean_s"]))
    print(f"{'stage (mean s)':<28}{'offline':>10}{'serving':>10}")
    for stage in stages:
        cells = [r["stage_durations_mean_s"].get(stage) for r in (offline, serving)]
        print(f"{stage:<28}" + "".join(f"{c:>10.3f}" if c is not None else f"{'-':>10}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint dir, hub id or tiny/<name> (not needed with --smoke)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--size", type=parse_size, default=(1024, 1024), help="N or WxH")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-enforce-eager compiles the transformer (CUDA)")
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--attention-backend", default=None, help="diffusion attention backend (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=len(load_gen.PROMPTS),
                        help="warm-up requests per path, one per distinct prompt by default (each text length "
                             "compiles and captures its own graphs when not eager)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server's /health")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny config-only Qwen-Image, dummy weights, 64x64, 2 steps, 4 prompts (CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/bench_serving_vs_offline-<UTC>.json)")
    args = parser.parse_args(argv)
    if not args.smoke and not args.model:
        parser.error("--model is required (or --smoke)")
    for name in ("steps", "num_prompts", "max_concurrency", "max_num_seqs", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = args.out or Path(__file__).resolve().parents[1] / "results" / (
        f"bench_serving_vs_offline-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_serving_vs_offline_") as tmp:
        if args.smoke:
            from write_config_only_checkpoint import write_checkpoint

            args.model = str(write_checkpoint("qwen-image", Path(tmp) / "qwen-image", tiny=True))
            args.load_format, args.size, args.steps = "dummy", (64, 64), 2
            args.num_prompts, args.max_concurrency, args.warmup = 4, 2, 1
        offline = run_offline(args)
        serving = run_serving(args, out.with_suffix(".server.log"))
    print_table(offline, serving)
    if serving["failed"]:
        print(f"{serving['failed']} serving request(s) failed: {serving['errors']}")
    result = {"command": " ".join([sys.executable, *sys.argv]), "args": {k: str(v) for k, v in vars(args).items()},
              "env": environment(), "offline": offline, "serving": serving,
              "serving_over_offline": serving["images_per_s"] / offline["images_per_s"]}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
