"""Fixtures: the tiny FLUX.2 klein checkpoints (process-group fixture `dist_world`: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def klein_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("flux2-klein")


@pytest.fixture(scope="session")
def klein_base_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("flux2-klein-base")
