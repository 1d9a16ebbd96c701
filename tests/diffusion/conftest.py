"""Fixtures shared by the diffusion tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def dist_world():
    """A gloo world of size 1 with vLLM's model-parallel groups and a current VllmConfig, for the module.

    vLLM's parallel linear layers need these groups even at tensor-parallel size 1. A module that finds groups
    already set up (by an earlier module in the same process) reuses them and leaves them to their owner.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            yield
        return
    config = init_diffusion_distributed(
        rank=0, world_size=1, parallel_config=DiffusionParallelConfig(), device=torch.device("cpu")
    )
    try:
        with set_current_vllm_config(config):
            yield
    finally:
        destroy_diffusion_distributed()
