"""tools/run_default.sh's one-model mode, live: `--host`/`--port` reach `vllm serve`, `--api-key` is enforced and
shows in the printed curls, and a chat model gets a chat curl (no images one). The script's setup step is kept:
it finds an up-to-date venv (wrappers around this interpreter, stamped as tools/setup_env.sh stamps), so nothing
is installed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.entrypoints.openai.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
STAMPED = [*sorted((ROOT / "requirements").glob("*.txt")), ROOT / "pyproject.toml", ROOT / "setup.py",
           *(ROOT / "tools" / name for name in ("setup_env.sh", "vllm_requirements.py", "vllm_dist_alias.py"))]


def _stamped_venv(path: Path) -> Path:
    """A venv setup_env.sh calls up to date: bin/python and bin/vllm run this interpreter's, plus its stamp."""
    (path / "bin").mkdir(parents=True)
    bin_dir = Path(sys.executable).parent
    for name in ("python", "vllm"):
        wrapper = path / "bin" / name
        wrapper.write_text(f'#!/usr/bin/env bash\nexec "{bin_dir / name}" "$@"\n')
        wrapper.chmod(0o755)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in STAMPED)).hexdigest()[:16]
    (path / ".vllm-omni-stamp").write_text(f"cpu-{digest}\n")
    return path


def test_one_model_mode(tmp_path):
    port = free_port()
    env = {**os.environ, "VLLM_OMNI_VENV": str(_stamped_venv(tmp_path / "venv")), "VLLM_OMNI_TARGET": "cpu"}
    proc = subprocess.Popen(["bash", "tools/run_default.sh", "tiny/qwen2", "--host", "127.0.0.1", "--port", str(port),
                             "--api-key", "secret", "--gpu-memory-utilization", "0.15", "--max-model-len", "512",
                             "--enforce-eager"],  # vLLM's CPU default compiles with inductor: ~20 s of CI
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any("Ctrl-C stops" in line for line in lines):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
        out = "".join(lines)
        assert "is up to date" in out, out[-3000:]
        assert f"tiny/qwen2 is ready at http://127.0.0.1:{port}" in out, out[-3000:]
        printed = out[out.index("is ready at"):]  # the requests to try, after the server's own log
        assert f"curl -s http://127.0.0.1:{port}/v1/chat/completions" in printed
        assert "Authorization: Bearer secret" in printed and "/v1/images/generations" not in printed
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny/qwen2", max_tokens=4,
                                               messages=[{"role": "user", "content": "hello"}])
        assert reply.usage.completion_tokens > 0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
