"""The stage-edge contract a model family's stage-input processors are written against: what they
receive (`StageInputContext`), what they may return (`StageInput`) and what they declare they read
(`reads`). The engine runs the processors (`vllm_omni/engine/stage_input_processors.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from vllm_omni.config.pipeline_config import EdgeField, EdgeStreamConfig

STAGE_DATA_KEY = "vllm_omni_stage_data"
"""Key of an AR stage's in-band stage data in vLLM's `kv_transfer_params` (what its model produced per request
besides tokens, returned with each engine step's outputs: models/qwen3_omni/slot_connector.py); the stage client
gathers it into `OmniRequestOutput.stage_data`, which the stage's output collector reads."""

StageInputProcessor = Callable[..., Any]
_Processor = TypeVar("_Processor", bound=StageInputProcessor)


@dataclass(frozen=True)
class ProcessorReads:
    """What a processor reads beyond the upstream tokens, declared with `reads(...)`."""

    edge_fields: frozenset[EdgeField] = frozenset()
    """The `EdgeStreamConfig` fields it reads from `context.edge` (streamed or not)."""
    partial_stage_data: Literal["every_chunk", "first_chunk"] = "every_chunk"
    """On a streamed edge, the upstream's collected `stage_data` of a running request (its output collector, per
    hand-off): "first_chunk" when the processor reads it from the first chunk only (e.g. a prompt capture,
    complete once the first token exists), so the orchestrator collects it for the first hand-off only."""


def reads(edge_fields: tuple[EdgeField, ...] = (),
          partial_stage_data: Literal["every_chunk", "first_chunk"] = "every_chunk") -> Callable[[_Processor],
                                                                                              _Processor]:
    """Declares what the processor reads (`ProcessorReads`)."""

    def declare(fn: _Processor) -> _Processor:
        fn.reads = ProcessorReads(frozenset(edge_fields), partial_stage_data)
        return fn

    return declare


def processor_reads(name: str) -> ProcessorReads:
    """What the named processor declared with `reads` (nothing beyond the tokens by default)."""
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    return getattr(MODEL_REGISTRY.stage_input_processor(name), "reads", ProcessorReads())


@dataclass
class StageInputContext:
    request_id: str
    stage: Any
    """The resolved config of the stage being fed (`VllmOmni*StageConfig`: model path, engine args, ...)."""
    sampling_params: Any
    """The caller's sampling params for that stage."""
    edge: EdgeStreamConfig | None = None
    """The edge's stream config (its `chunk_tokens` sizes what the processor cuts), None when not configured."""
    final: bool = True
    """False while the upstream stage is still running (streamed edge)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Kept across the calls of one request on a streamed edge (e.g. how far the input was handed on)."""
    output_token_ids: list[int] = field(default_factory=list)
    """A stream-fed AR stage's own output so far (all its input chunks)."""
    idle: bool = False
    """A stream-fed AR stage has consumed its last input chunk and waits for the next one."""


@dataclass
class StageInput:
    """A processor's result when it also decides the request's sampling params for the fed stage."""

    prompt: Any
    sampling_params: Any
