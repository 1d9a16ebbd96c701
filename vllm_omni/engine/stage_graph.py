"""The pipeline's stage graph: which stage feeds which and how (whole output or streamed), how far a request
runs, and the payloads on the edges (one connector per edge). No request runs here: `edges.py` drives them.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.catalog.edges import StageInputContext
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import StageConfig
from vllm_omni.connectors.base import OmniConnector, PayloadHandle, StagePayload
from vllm_omni.connectors.factory import make_connector
from vllm_omni.engine.stage_input_processors import get_stage_input_processor
from vllm_omni.errors import OmniClientError
from vllm_omni.outputs import OmniRequestOutput


class StageGraph:
    def __init__(self, config: VllmOmniConfig, stage_modalities: list[str]) -> None:
        """`stage_modalities`: the output modality of each stage (for requests that ask for some of them)."""
        self.stages: list[StageConfig] = list(config.stages)
        self.stage_modalities = stage_modalities
        self.connectors: dict[tuple[int, int], OmniConnector] = {
            (src, stage.stage_id): make_connector(config.connector_for(src, stage.stage_id))
            for stage in self.stages for src in stage.inputs}
        self.downstream = {i: [s.stage_id for s in self.stages if i in s.inputs] for i in range(len(self.stages))}
        self._last_final_stage = max((i for i, s in enumerate(self.stages) if s.final_output), default=0)

    def __len__(self) -> int:
        return len(self.stages)

    def is_final(self, stage_id: int) -> bool:
        return self.stages[stage_id].final_output

    def streamed_source(self, stage_id: int) -> int | None:
        """The upstream whose output streams into this stage while it runs (None: whole outputs only)."""
        return self.stages[stage_id].streamed_input()

    def last_stage(self, modalities: list[str] | None) -> int:
        """The last stage a request runs: the last final stage, or the last one making a requested modality."""
        if modalities is None:
            return self._last_final_stage
        finals = [i for i in range(len(self.stages)) if self.is_final(i)]
        wanted = [i for i in finals if self.stage_modalities[i] in modalities]
        if not wanted:
            available = sorted({self.stage_modalities[i] for i in finals})
            raise OmniClientError(f"modalities {sorted(modalities)} cannot be produced by this pipeline "
                                  f"(it outputs {available})", param="modalities")
        return max(wanted)

    def streams_any(self, last_stage: int) -> bool:
        return any(self.streamed_source(i) is not None for i in range(last_stage + 1))

    # ---- payloads on the edges ----------------------------------------------------------------------------
    def stage_input(self, request_id: str, handles: dict[tuple[int, int], PayloadHandle], stage_id: int,
                    original_prompt: Any, params: Any) -> tuple[Any, Any]:
        """(prompt, sampling params) of the request for `stage_id`, from its upstreams' whole outputs (an entry
        stage: the caller's, or what its input processor makes of them, e.g. a talker prompt from text)."""
        stage = self.stages[stage_id]
        if not stage.inputs and stage.input_processor is None:
            return original_prompt, params
        payloads = [self.connectors[(src, stage_id)].get(handles.pop((src, stage_id))) for src in stage.inputs]
        edge = stage.stream_inputs.get(stage.inputs[0]) if len(stage.inputs) == 1 else None
        context = StageInputContext(request_id=request_id, stage=stage, sampling_params=params, edge=edge)
        result = get_stage_input_processor(stage.input_processor)(payloads, original_prompt, context)
        return result.prompt, result.sampling_params

    def hand_off(self, request_id: str, handles: dict[tuple[int, int], PayloadHandle], stage_id: int,
                 out: OmniRequestOutput, last_stage: int, skip: set[int] = frozenset()) -> None:
        """Put the stage's whole output on each edge to a downstream the request runs (but `skip`)."""
        for dst in self.downstream[stage_id]:
            if dst <= last_stage and dst not in skip:
                handles[(stage_id, dst)] = self.connectors[(stage_id, dst)].put(request_id, stage_id, dst,
                                                                                payload(out))

    def put_chunk(self, request_id: str, src: int, dst: int, out: OmniRequestOutput, chunk: int) -> PayloadHandle:
        return self.connectors[(src, dst)].put(request_id, src, dst, payload(out), chunk=chunk)

    def get(self, src: int, dst: int, handle: PayloadHandle) -> StagePayload:
        return self.connectors[(src, dst)].get(handle)

    def drop_request(self, request_id: str) -> None:
        for connector in self.connectors.values():
            connector.drop_request(request_id)

    def close(self) -> None:
        for connector in self.connectors.values():
            connector.close()


def payload(out: OmniRequestOutput) -> StagePayload:
    """What a stage hands on: its text and tokens (with the prompt's), collected stage data and tensors."""
    prompt_ids = getattr(out.request_output, "prompt_token_ids", None)
    return StagePayload(metadata={"text": out.text, "token_ids": list(out.token_ids),
                                  "prompt_token_ids": list(prompt_ids or []),
                                  "stage_data": out.multimodal_output.get("stage_data", {})},
                        tensors=dict(out.multimodal_output.get("tensors", {})))
