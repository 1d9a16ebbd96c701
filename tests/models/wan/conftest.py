"""Wan tests: tiny checkpoints (the process-group fixture `dist_world` lives in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def wan21_t2v_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("wan2.1-t2v")


@pytest.fixture(scope="session")
def wan21_i2v_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("wan2.1-i2v")


@pytest.fixture(scope="session")
def wan22_a14b_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("wan2.2-t2v-a14b")
