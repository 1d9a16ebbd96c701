"""Stage-input processors: turn upstream stages' payloads into the next stage's prompt.

A pipeline names one per stage edge (`input_processor:` in its YAML). Each receives the payloads of the
stage's upstream stages (in `inputs` order) and the user's original prompt. A processor registered with
`takes_context=True` also receives a `StageInputContext` (the fed stage's resolved config and the caller's
sampling params for it) and may return a `StageInput` to set that request's sampling params too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.connectors.base import StagePayload

StageInputProcessor = Callable[..., Any]
_PROCESSORS: dict[str, tuple[StageInputProcessor, bool]] = {}


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


def register_stage_input_processor(name: str, *, takes_context: bool = False
                                   ) -> Callable[[StageInputProcessor], StageInputProcessor]:
    def decorator(fn: StageInputProcessor) -> StageInputProcessor:
        _PROCESSORS[name] = (fn, takes_context)
        return fn

    return decorator


def get_stage_input_processor(name: str) -> StageInputProcessor:
    """The processor as `fn(upstream, original_prompt, context) -> StageInput`, whatever its registered form."""
    from vllm_omni.config.omni_config import lookup_registered

    fn, takes_context = lookup_registered(_PROCESSORS, name, "stage input processor")

    def run(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> StageInput:
        result = fn(upstream, original_prompt, context) if takes_context else fn(upstream, original_prompt)
        return result if isinstance(result, StageInput) else StageInput(result, context.sampling_params)

    return run


@register_stage_input_processor("text_to_prompt")
def text_to_prompt(upstream: list[StagePayload], original_prompt: Any) -> Any:
    """The upstream stage's generated text becomes the prompt (e.g. prompt rewriter -> image model)."""
    text = upstream[-1].metadata.get("text") or ""
    if isinstance(original_prompt, dict) and "negative_prompt" in original_prompt:
        return {"prompt": text, "negative_prompt": original_prompt["negative_prompt"]}
    return text


@register_stage_input_processor("token_ids_to_prompt")
def token_ids_to_prompt(upstream: list[StagePayload], original_prompt: Any) -> Any:
    """The upstream AR stage's output tokens become the next AR stage's prompt tokens."""
    return {"prompt_token_ids": list(upstream[-1].metadata.get("token_ids") or [])}
