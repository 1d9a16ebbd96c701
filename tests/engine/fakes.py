"""Small in-process stage clients that pin the Orchestrator's and StagePool's contracts without vLLM."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.outputs import OmniRequestOutput


class FakeStageClient:
    """Echoes its prompt as text after `delay` seconds, streaming `chunks` partial outputs first."""

    def __init__(self, stage_id: int = 0, stage_type: str = "llm", final_output: bool = True, *,
                 delay: float = 0.0, chunks: int = 1, fail_with: BaseException | None = None) -> None:
        self.stage_id = stage_id
        self.stage_type = stage_type
        self.kind = StageKind(stage_type)
        self.final_output = final_output
        self.replica_id = 0
        self.delay = delay
        self.chunks = chunks
        self.fail_with = fail_with
        self.dead = False
        self.add_request_calls: list[tuple[str, Any]] = []
        self.abort_calls: list[list[str]] = []
        self.rpc_calls: list[tuple[str, tuple, dict | None]] = []
        self.name = f"fake-{stage_id}"

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any):
        self.add_request_calls.append((request_id, prompt))
        text = prompt if isinstance(prompt, str) else str(prompt)
        for i in range(self.chunks):
            await asyncio.sleep(self.delay / self.chunks)
            if self.fail_with is not None:
                raise self.fail_with
            finished = i == self.chunks - 1
            yield OmniRequestOutput(request_id=request_id, finished=finished, stage_id=self.stage_id,
                                    text=f"{text}|s{self.stage_id}" if finished else text[: i + 1],
                                    token_ids=[self.stage_id, i],
                                    stage_durations={f"stage{self.stage_id}": 0.001} if finished else {})

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_calls.append(list(request_ids))

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict | None = None) -> Any:
        self.rpc_calls.append((method, tuple(args), kwargs))
        return {"method": method, "stage": self.stage_id}

    @property
    def is_dead(self) -> bool:
        return self.dead

    @property
    def is_restarting(self) -> bool:
        return False


class ModelLessStage(StageClientBase):
    """A model-less AR stage for a real AsyncOmniEngine: subclasses give `generate`; start, shutdown and the
    client's other queries are no-ops."""

    kind = StageKind.AR

    async def start(self) -> None:
        return None

    def default_sampling_params(self):
        return None

    @property
    def output_modality(self) -> str:
        return "text"

    @property
    def is_dead(self) -> bool:
        return False

    def shutdown(self) -> None:
        return None
