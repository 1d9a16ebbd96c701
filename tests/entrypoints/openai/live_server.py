"""Start `vllm serve <model> --omni` through vLLM's own `vllm` entry point in a subprocess, for live tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0

# The servers that several modules share through tests/conftest.py's `shared_server` (one start per session).
QWEN2 = ("tiny/qwen2", "--gpu-memory-utilization", "0.15", "--max-model-len", "512", "--max-num-seqs", "8",
         "--enforce-eager")
"""tiny/qwen2 for the modules that only send requests: vLLM's routes and CLI, bad input (max-num-seqs 8 for vLLM's
bench at concurrency 8). Not test_live_chat.py's: its hermes tool parser sees every streamed delta and may hold some
back, which test_live_vllm_app.py's one-chunk-per-token check would see."""
QWEN_IMAGE_LONG = ("tiny/qwen-image", "--max-inference-steps", "100000")
"""tiny/qwen-image allowing requests of minutes, for the abort and soak modules."""
WAN_T2V_LONG = ("tiny/wan2.1-t2v", "--max-inference-steps", "100000")
"""tiny/wan2.1-t2v allowing requests of minutes, for the Videos API and abort modules."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        vllm = Path(sys.executable).with_name("vllm")
        # The `vllm` script is what users type; the GPU image has vLLM's Python tree only, without the script.
        launcher = [str(vllm)] if vllm.exists() else [sys.executable, "-m", "vllm_omni.entrypoints.cli.main"]
        cmd = [*launcher, "serve", model, "--omni", "--host", "127.0.0.1", "--port", str(self.port), *args]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        self.log = Path(f"/tmp/vllm_omni_live_{self.port}.log")
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._terminated = False
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # a start takes 10-40 s; polling finer finds it ready sooner
        self.close()
        raise TimeoutError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def terminate(self) -> None:
        """SIGTERM the server without waiting, so several servers shut down side by side; `close()` then waits."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True
            # Reaped as soon as it exits: a zombie child until `close()` would make psutil's `cmdline()` raise
            # (ZombieProcess) in later tests that list our children.
            threading.Thread(target=self.proc.wait, name=f"reap-{self.proc.pid}", daemon=True).start()

    def close(self) -> bool:
        """SIGTERM the server (it stops its engine); True when it exited cleanly leaving no process behind.

        Whatever is left of its process group afterwards is killed, so a failing test leaks nothing either.
        """
        clean = False
        if self.proc.poll() is None or self._terminated:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
                clean = not _group_alive(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()
        return clean


def _group_alive(pgid: int, grace_s: float = 15.0) -> bool:
    """Whether any process of the group is still alive `grace_s` after its leader exited."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.5)
    return True
