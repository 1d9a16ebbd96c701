"""The project's own env vars live in vllm_omni/envs.py: typed, read on access, and read nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_omni import envs
from vllm_omni.config.omni_config import StageConfigFactory
from vllm_omni.errors import OmniClientError

PACKAGE = Path(envs.__file__).parent


def test_values_are_typed_and_read_on_access(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFUSION_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", raising=False)
    assert envs.DIFFUSION_ATTENTION_BACKEND is None and envs.VLLM_OMNI_VIDEO_SYNC_TIMEOUT == 14400.0
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "TORCH_SDPA")
    monkeypatch.setenv("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "30")
    monkeypatch.setenv("VLLM_OMNI_TINY_CACHE", str(tmp_path))
    assert (envs.DIFFUSION_ATTENTION_BACKEND, envs.VLLM_OMNI_VIDEO_SYNC_TIMEOUT) == ("TORCH_SDPA", 30.0)
    assert tmp_path == envs.VLLM_OMNI_TINY_CACHE
    monkeypatch.setenv("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_OMNI_VIDEO_SYNC_TIMEOUT"):
        getattr(envs, "VLLM_OMNI_VIDEO_SYNC_TIMEOUT")  # noqa: B009 (the access is what is tested)
    with pytest.raises(AttributeError):
        getattr(envs, "NOT_A_KNOB")  # noqa: B009


def test_no_other_module_reads_these_variables():
    names = "|".join(envs.environment_variables)
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "envs.py" and re.search(rf"environ[^\n]*[\"']({names})[\"']", p.read_text())]
    assert not readers


def test_a_bad_backend_in_the_environment_is_refused_at_resolution(monkeypatch):
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "SAGE_ATTN")
    with pytest.raises(OmniClientError, match="env DIFFUSION_ATTENTION_BACKEND") as info:
        StageConfigFactory.create_from_model("tiny/qwen-image")
    assert info.value.param == "diffusion_attention_backend"
