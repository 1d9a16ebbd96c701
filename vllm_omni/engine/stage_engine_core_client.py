"""AR stage: vLLM's own engine (EngineCore in its own process behind vLLM's AsyncMPClient).

We compose vLLM's `AsyncLLM` (InputProcessor + OutputProcessor + AsyncMPClient), so scheduling, KV cache,
detokenization and liveness monitoring are vLLM's; this class only adapts it to the stage interface.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.output_collectors import get_output_collector
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.errors import EngineDeadError, EngineGenerateError, OmniClientError
from vllm_omni.logger import init_logger
from vllm_omni.models.spec import Modality
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

# EngineCore utilities (not worker methods) that `collective_rpc_async` forwards as utility calls.
_ENGINE_CORE_UTILITIES = frozenset({"reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache", "is_sleeping",
                                    "is_scheduler_paused"})


class StageEngineCoreClient(StageClientBase):
    kind = StageKind.AR

    def __init__(self, config, replica_id: int = 0) -> None:
        super().__init__(config, replica_id)
        self.llm = None

    async def start(self) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        start = time.perf_counter()
        engine_args = self.config.make_engine_args()
        vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        configured = time.perf_counter()
        # AsyncLLM's constructor blocks until EngineCore is ready; keep the loop free meanwhile.
        loop = asyncio.get_running_loop()
        self.llm = await asyncio.wait_for(
            loop.run_in_executor(None, lambda: AsyncLLM.from_vllm_config(
                vllm_config, disable_log_stats=engine_args.disable_log_stats)),
            timeout=self.config.stage_init_timeout,
        )
        logger.info("[%s] vLLM config in %.1f s, EngineCore ready in %.1f s", self.name, configured - start,
                    time.perf_counter() - configured)

    @property
    def vllm_config(self):
        return self.llm.vllm_config

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def default_sampling_params(self) -> Any:
        from vllm import SamplingParams

        defaults = self.llm.model_config.get_diff_sampling_param() or {}
        defaults.update(self.config.default_sampling_params)
        return SamplingParams.from_optional(**defaults) if defaults else SamplingParams()

    @property
    def output_modality(self) -> str:
        return self.config.final_output_type or "text"

    @property
    def input_modalities(self) -> frozenset[Modality]:
        """The family spec's declaration for a topology we define (e.g. Qwen3-Omni); text for any other LM."""
        from vllm_omni.models.registry import MODEL_REGISTRY

        spec = MODEL_REGISTRY.family_for(list(self.vllm_config.model_config.architectures))
        return spec.input_modalities if spec is not None else frozenset({"text"})

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        if not isinstance(sampling_params, SamplingParams):
            raise OmniClientError(f"stage {self.stage_id} is an AR stage and needs vLLM SamplingParams, got "
                                  f"{type(sampling_params).__name__}", param="sampling_params_list")
        start = time.perf_counter()
        try:
            async for out in self.llm.generate(prompt, sampling_params, request_id):
                completion = out.outputs[0] if out.outputs else None
                result = OmniRequestOutput(
                    request_id=request_id,
                    finished=out.finished,
                    stage_id=self.stage_id,
                    final_output_type=self.output_modality,
                    text=completion.text if completion else None,
                    token_ids=list(completion.token_ids) if completion else [],
                    request_output=out,
                )
                aborted = out.finished and completion is not None and completion.finish_reason == "abort"
                if aborted and not self.final_output:  # a truncated intermediate result must not feed on
                    raise EngineGenerateError(f"{self.name}: request {request_id} was aborted by the engine")
                if out.finished:
                    if self.config.output_collector is not None:
                        collect = get_output_collector(self.config.output_collector)
                        result.multimodal_output["stage_data"] = await collect(self, request_id, result)
                    elapsed = time.perf_counter() - start
                    # By type (as one-stage pipelines report it) and by stage (pipelines with several AR stages).
                    result.stage_durations[self.config.stage_type] = result.stage_durations[self.config.name] = elapsed
                yield result
        except VllmEngineDeadError as e:
            raise EngineDeadError(f"{self.name}: EngineCore died") from e
        except (VLLMClientError, ValueError) as e:  # vLLM input validation (prompt too long, bad params, ...)
            if self.llm.errored:
                raise EngineDeadError(f"{self.name}: EngineCore died") from e
            raise OmniClientError(f"stage {self.stage_id}: {e}", param=getattr(e, "parameter", None)) from e

    async def abort(self, request_ids: list[str]) -> None:
        if not self.llm.errored:
            await self.llm.abort(request_ids)

    # vLLM AsyncMPClient control helpers (StagePool calls these for pause/resume/sleep/wake).
    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self.llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def resume_scheduler_async(self) -> None:
        await self.llm.engine_core.resume_scheduler_async()

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self.llm.engine_core.sleep_async(level, mode)

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        return await self.llm.engine_core.wake_up_async(tags)

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
        core = self.llm.engine_core
        if method in _ENGINE_CORE_UTILITIES:
            return await core.call_utility_async(method, *_utility_args(method, args, kwargs))
        return await core.collective_rpc_async(method, timeout, tuple(args), kwargs)

    @property
    def is_dead(self) -> bool:
        return self.llm is not None and self.llm.errored

    def shutdown(self) -> None:
        """Shut the AsyncLLM down and drop it now: a reference kept until interpreter exit runs its `__del__`
        (another `shutdown`) after module globals are cleared, which prints "Exception ignored ... TypeError"."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown(timeout=10.0)


def _utility_args(method: str, args: tuple, kwargs: dict[str, Any] | None) -> tuple:
    """EngineCore utility calls carry positional arguments only: keywords go to their positions by the
    method's signature (a bad name is a TypeError here, not a wrong value over there)."""
    if not kwargs:
        return tuple(args)
    from vllm.v1.engine.core import EngineCore

    bound = inspect.signature(getattr(EngineCore, method)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:]
