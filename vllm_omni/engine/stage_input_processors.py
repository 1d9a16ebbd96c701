"""Stage-input processors: turn upstream stages' payloads into the next stage's prompt.

A pipeline names one per stage edge (`input_processor:` in its YAML): a name a model family's spec declares
(`ModelSpec.stage_input_processors`), one registered with `register_stage_input_processor`, or a "module:fn".
Each is called as `fn(upstream, original_prompt, context)`: the payloads of the stage's upstream stages (in
`inputs` order), the user's original prompt and a `StageInputContext` (the fed stage's resolved config and the
caller's sampling params for it); it returns the prompt, or a `StageInput` to set the sampling params too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.connectors.base import StagePayload

StageInputProcessor = Callable[..., Any]


@dataclass
class StageInputContext:
    request_id: str
    stage: Any
    """The resolved config of the stage being fed (`VllmOmni*StageConfig`: model path, engine args, ...)."""
    sampling_params: Any
    """The caller's sampling params for that stage."""


@dataclass
class StageInput:
    """A processor's result when it also decides the request's sampling params for the fed stage."""

    prompt: Any
    sampling_params: Any


def get_stage_input_processor(name: str) -> Callable[[list[StagePayload], Any, StageInputContext], StageInput]:
    """The processor as `fn(upstream, original_prompt, context) -> StageInput`."""
    from vllm_omni.models.registry import MODEL_REGISTRY

    fn = MODEL_REGISTRY.stage_input_processor(name)

    def run(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> StageInput:
        result = fn(upstream, original_prompt, context)
        return result if isinstance(result, StageInput) else StageInput(result, context.sampling_params)

    return run
