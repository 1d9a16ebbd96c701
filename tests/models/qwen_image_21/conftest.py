"""Fixtures: the tiny Qwen-Image-2.1 checkpoint (process-group fixture `dist_world`: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_image_21_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("qwen-image-2.1")
