"""Stage-input processors: turn upstream stages' payloads into the next stage's prompt.

A pipeline names one per stage edge (`input_processor:` in its YAML): a name a model family's spec declares
(`ModelSpec.stage_input_processors`), one registered with `register_stage_input_processor`, or a "module:fn".
Each is called as `fn(upstream, original_prompt, context)`: the payloads of the stage's upstream stages (in
`inputs` order), the user's original prompt and a `StageInputContext` (the fed stage's resolved config and the
caller's sampling params for it); it returns the prompt, or a `StageInput` to set the sampling params too.

On a streamed edge (`stream_inputs`) it is called once per chunk with the upstream output so far
(`context.final` on the last), keeps what it already handed on in `context.state`, and returns the next segment's
input, or None while a chunk brings too little for one. Into an AR stage the request is one vLLM streaming-input
request: the processor is also called when that stage has consumed its input (`context.idle`, its own output
in `context.output_token_ids`) and returns the next input chunk, None to wait, or `StageInput(None, None)` to
close the input.

A processor that reads fields of its edge's `EdgeStreamConfig` itself (e.g. `chunk_schedule`) says so with
`@reads(edge_fields=(...))`; pipeline resolution refuses a field set on an edge where nothing reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from vllm_omni.config.pipeline_config import EdgeField, EdgeStreamConfig
from vllm_omni.connectors.base import StagePayload

StageInputProcessor = Callable[..., Any]
_Processor = TypeVar("_Processor", bound=StageInputProcessor)


@dataclass(frozen=True)
class ProcessorReads:
    """What a processor reads beyond the upstream tokens, declared with `reads(...)`."""

    edge_fields: frozenset[EdgeField] = frozenset()
    """The `EdgeStreamConfig` fields it reads from `context.edge` (streamed or not)."""
    partial_stage_data: Literal["every_chunk", "first_chunk"] = "every_chunk"
    """On a streamed edge, the upstream's collected `stage_data` of a running request (an output-collector RPC
    per hand-off): "first_chunk" when the processor reads it from the first chunk only (e.g. a prompt capture,
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
    from vllm_omni.models.registry import MODEL_REGISTRY

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


def get_stage_input_processor(name: str) -> Callable[[list[StagePayload], Any, StageInputContext], StageInput | None]:
    """The processor as `fn(upstream, original_prompt, context) -> StageInput`."""
    from vllm_omni.models.registry import MODEL_REGISTRY

    fn = MODEL_REGISTRY.stage_input_processor(name)

    def run(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> StageInput | None:
        result = fn(upstream, original_prompt, context)
        if result is None or isinstance(result, StageInput):
            return result
        return StageInput(result, context.sampling_params)

    return run
