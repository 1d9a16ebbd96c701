"""Executors run scheduled batches on the diffusion workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.executor.multiproc_executor import MultiprocDiffusionExecutor


def make_executor(od_config: OmniDiffusionConfig) -> MultiprocDiffusionExecutor:
    """The stage's executor: worker processes of this host, or Ray actors when the deploy config says ray."""
    if od_config.ray is not None:
        from vllm_omni.diffusion.executor.ray_executor import RayDiffusionExecutor

        return RayDiffusionExecutor(od_config)
    from vllm_omni.diffusion.executor.multiproc_executor import MultiprocDiffusionExecutor

    return MultiprocDiffusionExecutor(od_config)
