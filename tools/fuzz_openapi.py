"""Fuzz a live `vllm serve MODEL --omni` with schemathesis and report how many requests got a 5xx.

Starts one server per model (tiny defaults: an image server and an AR server), runs schemathesis against its
OpenAPI schema for `--max-time` seconds, and counts 5xx answers from the server's own
`vllm_omni:http_requests_total` metric (what the server answered, whatever schemathesis concluded). The
control routes (/v1/omni/sleep|wakeup) are left out: a fuzzed sleep makes every later request a legitimate 503.

    pip install schemathesis   # no torch involved
    python tools/fuzz_openapi.py                        # tiny/qwen-image and tiny/qwen2, 120 s each
    python tools/fuzz_openapi.py --model tiny/qwen2 --max-time 60 -- --gpu-memory-utilization 0.05

Exit status 1 when any 5xx was seen.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.entrypoints.openai.live_server import LiveServer  # noqa: E402

DEFAULT_MODELS = ("tiny/qwen-image", "tiny/qwen2")
SERVER_ARGS = {
    # Bounds that keep fuzzed-but-valid requests cheap on a CPU.
    "tiny/qwen-image": ("--max-inference-steps", "2", "--max-output-pixels", "16384", "--max-request-outputs", "2"),
    "tiny/qwen2": ("--gpu-memory-utilization", "0.05", "--max-model-len", "512"),
}


def status_counts(url: str) -> dict[str, float]:
    """{"<route> <status>": count} from the server's metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm_omni:http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            status = labels.split('status="', 1)[1].split('"', 1)[0]
            counts[f"{route} {status}"] = counts.get(f"{route} {status}", 0.0) + float(value)
    return counts


def fuzz(model: str, max_time: int, extra: list[str]) -> tuple[int, int]:
    """(requests answered, 5xx answers) for one model's server."""
    server = LiveServer(model, *SERVER_ARGS.get(model, ()), *extra)
    try:
        before = status_counts(server.url)
        # Build the (cached) schema once with a patient timeout: vLLM's app has many routes, and schemathesis
        # gives up loading it after 10 s on a busy machine.
        httpx.get(f"{server.url}/openapi.json", timeout=300).raise_for_status()
        cmd = [shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis")), "run",
               f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--max-time", str(max_time),
               "--request-timeout", "300", "--workers", "1", "--continue-on-failure", "--no-color",
               "--exclude-path-regex", "^/v1/omni/", "--suppress-health-check", "all"]
        with tempfile.TemporaryDirectory() as scratch:  # schemathesis keeps its caches in the working directory
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=max_time + 600, cwd=scratch)
        print(run.stdout[-6000:], run.stderr[-2000:], sep="\n")
        after = status_counts(server.url)
    finally:
        server.close()
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}
    errors = {k: v for k, v in delta.items() if k.rsplit(" ", 1)[1].startswith("5")}
    print(f"{model}: {int(sum(delta.values()))} requests; 5xx: {int(sum(errors.values()))} {errors or ''}")
    return int(sum(delta.values())), int(sum(errors.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model to serve (repeatable); default: "
                        + ", ".join(DEFAULT_MODELS))
    parser.add_argument("--max-time", type=int, default=120, help="seconds of fuzzing per server")
    parser.add_argument("server_args", nargs="*", help="extra `vllm serve` flags (after --)")
    args = parser.parse_args()
    total_5xx = 0
    for model in args.model or DEFAULT_MODELS:
        total_5xx += fuzz(model, args.max_time, args.server_args)[1]
    sys.exit(1 if total_5xx else 0)


if __name__ == "__main__":
    main()
