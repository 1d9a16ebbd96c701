"""Set up torch.distributed and vLLM's model-parallel groups for one diffusion worker.

Every worker gets a process group even when it is alone (gloo on CPU, nccl on CUDA), so a pipeline
written with vLLM's `ColumnParallelLinear` / `RowParallelLinear` runs unchanged at any tensor-parallel
size. Tests call `init_diffusion_distributed` in-process with world_size 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_omni.diffusion.data import DiffusionParallelConfig


def make_vllm_config(parallel_config: DiffusionParallelConfig) -> VllmConfig:
    """The VllmConfig vLLM's layers and group setup read as "current" (parallel sizes only)."""
    from vllm.config import ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=parallel_config.tensor_parallel_size))


def init_diffusion_distributed(
    *,
    rank: int,
    world_size: int,
    parallel_config: DiffusionParallelConfig,
    device: torch.device,
    distributed_init_method: str | None = None,
) -> VllmConfig:
    """Initialize the world group and vLLM's TP/PP groups; returns the VllmConfig to keep current."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    if parallel_config.world_size != world_size:
        raise ValueError(f"parallel config needs {parallel_config.world_size} ranks, got world_size={world_size}")
    if distributed_init_method is None:
        if world_size > 1:
            raise ValueError("distributed_init_method is required for more than one rank")
        distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
    backend = "nccl" if device.type == "cuda" else "gloo"
    local_rank = (device.index or 0) if device.type == "cuda" else rank
    vllm_config = make_vllm_config(parallel_config)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=distributed_init_method,
            local_rank=local_rank,
            backend=backend,
        )
        initialize_model_parallel(tensor_model_parallel_size=parallel_config.tensor_parallel_size)
    return vllm_config


def destroy_diffusion_distributed() -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
