"""Fixtures: the tiny FLUX.1-dev checkpoint and a single-rank vLLM process group kept current for the session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def flux_vllm_config():
    """torch.distributed (gloo) + vLLM model-parallel groups of size 1, with a current VllmConfig."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):
        owned = not model_parallel_is_initialized()
        if owned:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
            initialize_model_parallel(1)
        yield
        if owned:
            destroy_model_parallel()
            destroy_distributed_environment()


@pytest.fixture(scope="session")
def flux_dir() -> Path:
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("flux")
