"""`vllm bench serve` (vLLM's own client) against plain `vllm serve` and `vllm serve ... --omni` on the same tiny
model, in one run: request throughput, mean ITL and mean TPOT side by side (issue 18's acceptance: throughput
>= 0.98x plain vLLM's, mean ITL <= 1.1x).

Workload: openai-chat backend on /v1/chat/completions, random dataset (32-token prompts, 16 output tokens,
ignore_eos), 200 prompts, concurrency 8. One server at a time (two idle engines on a small machine slow each
other down). Prints a table and writes benchmarks/results/bench_vllm_serve_itl-<UTC>.json and a PNG bar chart
next to it.

    .venv/bin/python benchmarks/serving/bench_vllm_serve_itl.py [--num-prompts 200] [--concurrency 8]
"""

from __future__ import annotations

import argparse
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

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny/qwen2"
SERVER_FLAGS = ["--gpu-memory-utilization", "0.15", "--max-model-len", "512", "--max-num-seqs", "8",
                "--enforce-eager"]
METRICS = ("request_throughput", "mean_itl_ms", "mean_tpot_ms", "mean_ttft_ms")
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


def bench(url: str, tokenizer: str, args: argparse.Namespace, out_dir: Path, name: str) -> dict:
    cmd = [VLLM, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", url, "--model", MODEL, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
           "--disable-tqdm", "--seed", "0", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", f"{name}.json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads((out_dir / f"{name}.json").read_text())
    if result["completed"] != args.num_prompts:
        raise RuntimeError(f"{name}: {result['completed']} of {args.num_prompts} requests completed")
    return {key: result[key] for key in METRICS}


def plot(path: Path, results: dict[str, dict]) -> None:
    """Bars of omni / plain per metric (PIL: the benchmark needs no plotting library)."""
    from PIL import Image, ImageDraw

    width, height, margin = 640, 360, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    ratios = {key: results["omni"][key] / results["plain"][key] for key in METRICS}
    top = max(1.5, *ratios.values())
    base_y = height - margin
    draw.line([(margin, base_y), (width - 20, base_y)], fill="black")
    one = base_y - (base_y - margin) / top
    draw.line([(margin, one), (width - 20, one)], fill="gray")
    draw.text((5, one - 6), "1.0x", fill="gray")
    slot = (width - margin - 20) / len(METRICS)
    for i, (key, ratio) in enumerate(ratios.items()):
        x0 = margin + i * slot + slot * 0.2
        y0 = base_y - (base_y - margin) * ratio / top
        draw.rectangle([x0, y0, x0 + slot * 0.6, base_y], fill="steelblue")
        draw.text((x0, base_y + 5), key.replace("_ms", ""), fill="black")
        draw.text((x0, y0 - 14), f"{ratio:.3f}x", fill="black")
    draw.text((margin, 10), "vllm serve --omni / plain vllm serve (vllm bench serve, tiny/qwen2)", fill="black")
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from vllm_omni.models.tiny import resolve_model

    model_path = resolve_model(MODEL)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, omni in (("plain", False), ("omni", True)):
            server = Server(model_path, omni, Path(tmp) / f"{name}.log")
            try:
                results[name] = bench(server.url, model_path, args, Path(tmp), name)
            finally:
                server.close()
    ratios = {key: results["omni"][key] / results["plain"][key] for key in METRICS}
    print(f"{'metric':<20}{'vllm serve':>12}{'--omni':>12}{'ratio':>8}")
    for key in METRICS:
        print(f"{key:<20}{results['plain'][key]:>12.3f}{results['omni'][key]:>12.3f}{ratios[key]:>8.3f}")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"bench_vllm_serve_itl-{stamp}.json"
    out.write_text(json.dumps({"workload": vars(args), "model": MODEL, "results": results, "ratios": ratios,
                               "machine": platform.platform(), "cpus": os.cpu_count()}, indent=2))
    plot(out.with_suffix(".png"), results)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
