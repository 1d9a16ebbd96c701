"""LTX-2 tests: the tiny checkpoint (the process-group fixture `dist_world` lives in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ltx2_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("ltx2")
