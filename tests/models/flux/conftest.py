"""Fixtures: the tiny FLUX.1-dev checkpoint (process-group fixture `dist_world`: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def flux_dir() -> Path:
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("flux")
