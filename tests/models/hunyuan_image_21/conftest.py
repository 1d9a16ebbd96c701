"""Fixtures: the tiny HunyuanImage-2.1 checkpoints (process-group fixture `dist_world`: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hunyuan_image_21_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("hunyuan-image-2.1")


@pytest.fixture(scope="session")
def hunyuan_image_21_distilled_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("hunyuan-image-2.1-distilled")
