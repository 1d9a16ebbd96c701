"""Shared fixtures: the tiny checkpoints and a single-rank vLLM process group for the parallel linears."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def dist_init():
    """torch.distributed (gloo) + vLLM model-parallel groups of size 1 in this process.

    Reuses groups another fixture already set up, and tears down only what it created, at module end, so
    other test folders' fixtures can set up their own afterwards.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.utils.network_utils import get_open_port

    owned = not model_parallel_is_initialized()
    if owned:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
            initialize_model_parallel(1)
    yield
    if owned:
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.fixture(scope="session")
def qwen_image_dir() -> Path:
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("qwen-image")


@pytest.fixture(scope="session")
def qwen_image_edit_dir() -> Path:
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("qwen-image-edit")

