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
from typing import Any

from vllm_omni.catalog.edges import StageInput, StageInputContext
from vllm_omni.connectors.base import StagePayload


def get_stage_input_processor(name: str) -> Callable[[list[StagePayload], Any, StageInputContext], StageInput | None]:
    """The processor as `fn(upstream, original_prompt, context) -> StageInput`."""
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    fn = MODEL_REGISTRY.stage_input_processor(name)

    def run(upstream: list[StagePayload], original_prompt: Any, context: StageInputContext) -> StageInput | None:
        result = fn(upstream, original_prompt, context)
        if result is None or isinstance(result, StageInput):
            return result
        return StageInput(result, context.sampling_params)

    return run
