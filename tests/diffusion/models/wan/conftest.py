"""Wan tests: an in-process gloo world of size 1 (vLLM's parallel layers need its groups) and tiny checkpoints."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def dist_world():
    """A gloo world of size 1 with vLLM's TP groups, current for the whole session (reused if one exists)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():  # another test module's world: use it, leave it to its owner
        with set_current_vllm_config(VllmConfig()):
            yield None
        return
    config = init_diffusion_distributed(rank=0, world_size=1, parallel_config=DiffusionParallelConfig(),
                                        device=torch.device("cpu"))
    with set_current_vllm_config(config):
        yield config
    destroy_diffusion_distributed()


@pytest.fixture(scope="session")
def wan21_t2v_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.1-t2v")


@pytest.fixture(scope="session")
def wan21_i2v_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.1-i2v")


@pytest.fixture(scope="session")
def wan22_a14b_dir():
    from vllm_omni.testing.tiny_models import build_tiny

    return build_tiny("wan2.2-t2v-a14b")
