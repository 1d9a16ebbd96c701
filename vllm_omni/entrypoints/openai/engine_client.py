"""vLLM's `EngineClient` for the AR stage that starts an omni pipeline, so vLLM's own serving classes
(completions, responses, tokenize, models, chat with logprobs) run on an `AsyncOmni` unchanged.

Requests go through the Orchestrator like every other request (abort, admission, sleep, restarts and the
omni metrics stay in one place): `generate` submits the prompt with the given SamplingParams for the AR stage
(every other stage keeps its default) and asks only for text, so a Qwen3-Omni server answers
`/v1/completions` from its thinker without running the talker. The stage's vLLM objects that the serving
classes read (config, renderer, input processor) are the stage's own `AsyncLLM`'s, which runs on the caller's
(the server's) loop like every stage: calls on it are awaited here, each bounded in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import VLLMValidationError

from vllm_omni.errors import OmniClientError, client_error_from_metadata

LOOP_CALL_TIMEOUT_S = 30.0
SERVED_TASKS = ("generate",)

_REFUSED_DEFAULTS = {"lora_request": None, "priority": 0, "data_parallel_rank": None, "session_id": None,
                     "kv_hints": None, "reasoning_ended": None, "reasoning_parser_kwargs": None}
"""`generate` arguments the omni stage path does not carry to the AR stage: anything but the default is
refused (400), never dropped."""


class OmniStageEngineClient(EngineClient):
    def __init__(self, omni: Any, stage_id: int = 0) -> None:
        self.omni = omni
        self.stage_id = stage_id

    # The AR stage's vLLM objects. Looked up per use: a restarted stage has a new AsyncLLM.
    @property
    def _llm(self) -> Any:
        llm = self.omni.engine.stage_clients[self.stage_id].llm
        if llm is None:
            raise client_error_from_metadata(f"stage {self.stage_id} is restarting", status_code=503,
                                             error_type=None)
        return llm

    @property
    def llm_build(self) -> int:
        """Which of the stage's AsyncLLMs serves now (it counts them); 503 while none does (being re-created)."""
        self._llm  # noqa: B018  (raises the 503)
        return self.omni.engine.stage_clients[self.stage_id].llm_builds

    @property
    def vllm_config(self) -> Any:
        return self._llm.vllm_config

    @property
    def model_config(self) -> Any:
        return self._llm.model_config

    @property
    def renderer(self) -> Any:
        return self._llm.renderer

    @property
    def input_processor(self) -> Any:
        return self._llm.input_processor

    async def _call_stage(self, coro: Any) -> Any:
        """A call on the stage's AsyncLLM (which runs on this, the caller's, loop), bounded in time."""
        return await asyncio.wait_for(coro, LOOP_CALL_TIMEOUT_S)

    # State ------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self.omni.is_dead

    @property
    def is_stopped(self) -> bool:
        return self.omni.is_dead

    @property
    def errored(self) -> bool:
        return self.omni.errored

    @property
    def dead_error(self) -> BaseException:
        return self.omni.dead_error

    async def check_health(self) -> None:
        await self.omni.check_health()

    async def is_tracing_enabled(self) -> bool:
        return False

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's tasks for the stage that this path carries: text generation. Transcription / realtime (audio
        input) and pooling are not routed through the pipeline, so vLLM's routes for them are not mounted."""
        tasks = await self._call_stage(self._llm.get_supported_tasks())
        return tuple(task for task in tasks if task in SERVED_TASKS)

    # Requests ---------------------------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *, prompt_text: str | None = None,
                       tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        """The AR stage's vLLM `RequestOutput`s for `prompt` (already rendered by vLLM's serving class)."""
        for name, value in kwargs.items():
            if name not in _REFUSED_DEFAULTS:
                raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
            if value != _REFUSED_DEFAULTS[name]:
                # vLLM's serving turns its own validation error into the error body, naming the field
                raise VLLMValidationError(f"{name} is not supported with --omni (the pipeline's AR stage runs "
                                          "with its own engine arguments)", parameter=name)
        params: list[Any] = [None] * self.omni.num_stages
        params[self.stage_id] = sampling_params
        async for output in self.omni.generate(prompt, request_id, params, output_modalities=["text"]):
            if output.error is not None:
                raise client_error_from_metadata(output.error, status_code=output.error_status_code,
                                                 error_type=None)
            if output.stage_id == self.stage_id and output.request_output is not None:
                yield output.request_output

    async def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        raise OmniClientError("pooling (embeddings, scores) is not served by omni pipelines", status_code=404)
        yield  # an async generator, as the protocol declares

    async def abort(self, request_id: str | Iterable[str]) -> None:
        await self.omni.abort(request_id if isinstance(request_id, str) else list(request_id))

    async def add_lora(self, lora_request: Any) -> bool:
        raise OmniClientError("LoRA adapters are not supported with --omni", param="lora")

    async def notify_kv_transfer_request_rejected(self, request_id: str, kv_transfer_params: dict[str, Any],
                                                  data_parallel_rank: int | None = None) -> None:
        await self._call_stage(self._llm.notify_kv_transfer_request_rejected(
            request_id, kv_transfer_params, data_parallel_rank=data_parallel_rank))

    async def do_log_stats(self) -> None:
        """The stage logs its own stats periodically (it owns the AsyncLLM); an extra call logs now."""
        await self._call_stage(self._llm.do_log_stats())

    # Control: the pipeline-wide operations of AsyncOmni ----------------------------------------------
    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        await self._call_stage(self._llm.start_profile(*args, **kwargs))

    async def stop_profile(self) -> None:
        await self._call_stage(self._llm.stop_profile())

    async def reset_mm_cache(self) -> None:
        await self.omni.reset_mm_cache()

    async def reset_encoder_cache(self) -> None:
        await self.omni.reset_encoder_cache()

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return await self.omni.reset_prefix_cache(reset_running_requests, reset_connector)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self.omni.sleep(level=level)

    async def release_kv_cache_memory(self) -> None:
        await self._call_stage(self._llm.release_kv_cache_memory())

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        await self.omni.wake_up(tags=tags)
        return True

    async def is_sleeping(self) -> bool:
        return self.omni.is_sleeping

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True, **kwargs: Any) -> None:
        await self.omni.pause_generation(mode=mode)

    async def resume_generation(self) -> None:
        await self.omni.resume_generation()

    async def is_paused(self) -> bool:
        return self.omni.is_paused()

    def shutdown(self, timeout: float | None = None) -> None:
        self.omni.close()
