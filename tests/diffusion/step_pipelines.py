"""Native pipelines with an injected fault, for the step-execution tests (importable by worker processes).

A request whose prompt contains `FAIL` raises inside `predict_noise` at its second step; every other request
runs the real pipeline unchanged.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.pipeline_base import DenoiseState
from vllm_omni.models.flux.pipeline import FluxPipeline
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

FAIL_MARK = "FAIL"
FAIL_STEP = 1


class InjectedFault(RuntimeError):
    pass


class _FaultInjection:
    def predict_noise(self, state: DenoiseState) -> torch.Tensor:
        if state.step_index == FAIL_STEP and any(FAIL_MARK in r.prompt_text for r in state.requests):
            raise InjectedFault(f"injected fault at step {FAIL_STEP}")
        return super().predict_noise(state)


class FaultyQwenImagePipeline(_FaultInjection, QwenImagePipeline):
    pass


class FaultyFluxPipeline(_FaultInjection, FluxPipeline):
    pass
