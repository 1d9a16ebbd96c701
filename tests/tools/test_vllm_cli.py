"""vLLM's own CLI on our install (tools/setup_env.sh): `vllm --version` answers, and `vllm bench serve` and
`vllm chat` run against a live `vllm serve tiny/qwen2 --omni` (on the CPU build they need the `vllm`
distribution alias that tools/vllm_dist_alias.py writes). `--version` runs the `vllm` script's function,
`vllm.entrypoints.cli.main.main`, in this process (tools/check_docs.py's runner): a fresh interpreter is 10 s of
torch and vLLM imports, 55-79 s on a loaded CI machine. `bench serve` and `chat` run the `vllm` script: run in this
process, they left triton objects that nanobind reported as leaked at the test process's exit.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.openai.live_server import QWEN2
from vllm_omni.catalog.tiny import resolve_model

MODEL = QWEN2[0]
ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
check_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_docs)
VLLM = str(Path(sys.executable).with_name("vllm"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _vllm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_version():
    out = check_docs.run_cli_in_process(["vllm", "--version"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == importlib.metadata.version("vllm")


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*QWEN2)


def test_bench_serve(server, tmp_path):
    """The openai-chat backend on the random dataset: every prompt completes with the tokens asked for."""
    out = _vllm("bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                "--base-url", server.url, "--model", MODEL, "--tokenizer", resolve_model(MODEL),
                "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
                "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
                "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 8
    assert result["request_throughput"] > 0


def test_chat_quick(server):
    out = _vllm("chat", "--url", f"{server.url}/v1", "--model-name", MODEL, "--quick", "hello", "--stats")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "TTFT:" in out.stdout and "tokens/s" in out.stdout
