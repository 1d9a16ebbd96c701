"""Generic stage-input processors: an AR stage's answer feeds the next stage of any pipeline."""

from __future__ import annotations

from typing import Any

from vllm_omni.catalog.edges import StageInputContext
from vllm_omni.connectors.base import StagePayload


def text_to_prompt(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> Any:
    """The upstream stage's generated text becomes the prompt (e.g. prompt rewriter -> image model)."""
    text = upstream[-1].metadata.get("text") or ""
    if isinstance(original_prompt, dict) and "negative_prompt" in original_prompt:
        return {"prompt": text, "negative_prompt": original_prompt["negative_prompt"]}
    return text


def token_ids_to_prompt(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> Any:
    """The upstream AR stage's output tokens become the next AR stage's prompt tokens."""
    return {"prompt_token_ids": list(upstream[-1].metadata.get("token_ids") or [])}
