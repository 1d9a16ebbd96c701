"""Native pipelines with injected faults, for the step-execution tests (importable by worker processes).

At its second step a request whose prompt contains `FAIL` raises while its transformer inputs are built (its
own fault); one whose prompt contains `CRASH` makes the transformer forward that holds its rows raise (a
fault of the shared forward, as an OOM or a kernel error would be). Every other request runs the real
pipeline unchanged.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.diffusion.state import DenoiseState
from vllm_omni.models.flux.pipeline import FluxPipeline
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline
from vllm_omni.models.wan.pipeline import WanPipeline

FAIL_MARK = "FAIL"
CRASH_MARK = "CRASH"
FAIL_STEP = 1


class InjectedFault(RuntimeError):
    pass


class _FaultInjection:
    def step_inputs(self, state: DenoiseState) -> Any:
        inputs = super().step_inputs(state)
        if state.step_index == FAIL_STEP:
            if any(FAIL_MARK in r.prompt_text for r in state.requests):
                raise InjectedFault(f"injected fault at step {FAIL_STEP}")
            if any(CRASH_MARK in r.prompt_text for r in state.requests):
                inputs.crash = True
        return inputs

    def forward_step_inputs(self, inputs: list[Any], states: list[Any]) -> list[Any]:
        if any(getattr(inp, "crash", False) for inp in inputs):
            raise InjectedFault(f"injected forward fault at step {FAIL_STEP}")
        return super().forward_step_inputs(inputs, states)


class FaultyQwenImagePipeline(_FaultInjection, QwenImagePipeline):
    pass


class FaultyFluxPipeline(_FaultInjection, FluxPipeline):
    pass


class FaultyWanPipeline(_FaultInjection, WanPipeline):
    pass
