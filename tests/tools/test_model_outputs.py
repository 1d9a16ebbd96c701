"""tools/model_outputs.py tells tools/run_default.sh which requests to print: it must decide like the server
(diffusion pipelines by their output modality, AR-first topologies by whether a generation stage makes audio)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[2] / "tools" / "model_outputs.py"
_spec = importlib.util.spec_from_file_location("model_outputs", _path)
model_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_outputs)


@pytest.mark.parametrize(("model", "expected"), [("tiny/qwen2", "chat"), ("tiny/qwen-image", "image"),
                                                 ("tiny/wan2.1-t2v", "video"), ("tiny/qwen3-omni", "chat-audio")])
def test_outputs(model, expected):
    assert model_outputs.main(model) == expected
