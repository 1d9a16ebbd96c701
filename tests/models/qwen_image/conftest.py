"""Shared fixtures: the tiny checkpoints (the process-group fixture `dist_world` is in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_image_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("qwen-image")


@pytest.fixture(scope="session")
def qwen_image_edit_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("qwen-image-edit")

