"""Stage-input processors: turn upstream stages' payloads into the next stage's prompt.

A pipeline names one per stage edge (`input_processor:` in its YAML). Each receives the payloads of the
stage's upstream stages (in `inputs` order) and the user's original prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_omni.connectors.base import StagePayload

StageInputProcessor = Callable[[list[StagePayload], Any], Any]
_PROCESSORS: dict[str, StageInputProcessor] = {}


def register_stage_input_processor(name: str) -> Callable[[StageInputProcessor], StageInputProcessor]:
    def decorator(fn: StageInputProcessor) -> StageInputProcessor:
        _PROCESSORS[name] = fn
        return fn

    return decorator


def get_stage_input_processor(name: str) -> StageInputProcessor:
    if name not in _PROCESSORS:
        raise ValueError(f"unknown stage input processor {name!r}; known: {sorted(_PROCESSORS)}")
    return _PROCESSORS[name]


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
