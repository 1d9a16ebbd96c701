"""`vllm serve` forks a diffusion core at its entry only for a diffusers checkpoint on disk, and one it never
hands a stage is stopped at once, with nothing behind (adoption: test_stage_diffusion_client.py)."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from vllm_omni.entrypoints.cli.main import _prestart_diffusion_core


@pytest.fixture
def diffusers_dir(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return tmp_path


@pytest.fixture
def transformers_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    return tmp_path


@pytest.mark.parametrize("argv", [
    [],
    ["--port", "8000"],
    ["--model"],
    ["tiny/no-such-model"],
    ["no/such-hub-id"],
    ["{model}", "--pipeline-config", "p.yaml"],
    ["{model}", "--help"],
    ["{model}", "--help=all"],
])
def test_no_prestart_where_it_would_not_be_used(argv, diffusers_dir):
    assert _prestart_diffusion_core([a.format(model=diffusers_dir) for a in argv]) is None


def test_no_prestart_for_a_transformers_checkpoint(transformers_dir):
    assert _prestart_diffusion_core([str(transformers_dir), "--omni"]) is None


def test_an_unadopted_prestart_stops_when_let_go(diffusers_dir):
    for argv in ([str(diffusers_dir), "--omni"], ["--model", str(diffusers_dir)]):
        prestarted = _prestart_diffusion_core(argv)
        assert prestarted is not None and prestarted.process.is_alive()
        child = psutil.Process(prestarted.process.pid)
        start = time.monotonic()
        prestarted.close()
        prestarted.close()  # idempotent
        assert time.monotonic() - start < 5.0
        assert prestarted.process.exitcode == -signal.SIGTERM and not psutil.pid_exists(child.pid)
        assert prestarted.adopt(object(), "DiffusionCore-0") is None  # let go: a stage spawns its core instead
