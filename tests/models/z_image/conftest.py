"""Fixtures: the tiny Z-Image-Turbo checkpoint (process-group fixture `dist_world`: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def z_image_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("z-image-turbo")
