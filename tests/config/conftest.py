from __future__ import annotations

import json

import pytest


@pytest.fixture
def omni_dir(tmp_path, monkeypatch):
    """A Qwen3-Omni checkpoint's config alone (what resolution reads), on a host whose environment sets neither
    the AR stages' OpenMP CPU sets nor their CPU KV cache size."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    d = tmp_path / "omni"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
                                               "model_type": "qwen3_omni_moe"}))
    return d
