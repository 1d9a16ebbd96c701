"""Output collectors: fetch what a finished AR request produced besides tokens, for the next stage.

Some AR stage models compute per-request results outside vLLM's token stream (e.g. the Qwen3-Omni talker's
residual codebooks, kept in the worker). A pipeline names a collector per stage (`output_collector:`, a name a
family's spec declares or one registered with `register_output_collector`); the AR
stage client awaits it once per finished request, and the returned dict travels to the downstream stages'
processors as `payload.metadata["stage_data"]`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

OutputCollector = Callable[[Any, str, Any], Awaitable[dict[str, Any]]]
"""`async fn(stage_client, request_id, output: OmniRequestOutput) -> stage_data`."""


def get_output_collector(name: str) -> OutputCollector:
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    return MODEL_REGISTRY.output_collector(name)
