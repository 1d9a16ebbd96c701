"""AR stage: vLLM's own engine (EngineCore in its own process behind vLLM's AsyncMPClient).

We compose vLLM's `AsyncLLM` (InputProcessor + OutputProcessor + AsyncMPClient), so scheduling, KV cache,
detokenization and liveness monitoring are vLLM's; this class only adapts it to the stage interface.

When vLLM marks the AsyncLLM errored (its EngineCore died), the stage shuts it down at once (vLLM's
`shutdown()` reaps the EngineCore and its workers and frees their shared memory) and builds a new one from
the same engine arguments, up to `max_stage_restarts` times, as the diffusion stage replaces its workers:
the requests it ran fail with `StageRestartingError` (503), new ones get 503 until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from multiprocessing import shared_memory
from typing import Any

from vllm_omni.catalog.edges import STAGE_DATA_KEY
from vllm_omni.catalog.spec import Modality
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.output_collectors import get_output_collector
from vllm_omni.engine.spawn_env import spawn_environ
from vllm_omni.engine.stage_client import StageClientBase, cancel_task
from vllm_omni.errors import EngineDeadError, EngineGenerateError, OmniClientError, StageRestartingError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

# EngineCore utilities (not worker methods) that `collective_rpc_async` forwards as utility calls.
_ENGINE_CORE_UTILITIES = frozenset({"reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache", "is_sleeping",
                                    "is_scheduler_paused"})
# How often the stage looks at vLLM's `errored` flag when no request would notice the death.
_DEATH_POLL_INTERVAL_S = 0.2
_SHUTDOWN_TIMEOUT_S = 10.0


class StageEngineCoreClient(StageClientBase):
    kind = StageKind.AR

    def __init__(self, config, replica_id: int = 0) -> None:
        super().__init__(config, replica_id)
        self.llm = None
        self._restarts = 0
        self._restart_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._dead = False
        self._core_segments: set[str] = set()
        self._building: Future | None = None
        """An AsyncLLM being constructed (its EngineCore starting); `shutdown` takes it over so that a
        shutdown during a restart never leaves a half-built engine running."""
        self.metrics_registry = None
        """This stage's vLLM `vllm:*` Prometheus series (a fresh registry per AsyncLLM; see stage_metrics)."""
        self._stats_task: asyncio.Task | None = None
        self.llm_builds = 0
        """How many AsyncLLMs this stage has adopted (1 + its restarts): whoever keeps objects made from the
        AsyncLLM (vLLM's serving classes keep its renderer and input processor) makes them again when it moves."""

    async def start(self) -> None:
        await self._start_llm()
        self.on_loop()

    def on_loop(self) -> None:
        """The death watch and vLLM's stats log line run on the driving loop (moved there from `start`'s)."""
        for task in (self._watch_task, self._stats_task):
            if task is not None:
                task.cancel()
        self._watch_task = asyncio.create_task(self._watch(), name=f"{self.name}-watch")
        if not self.config.make_engine_args().disable_log_stats:
            self._stats_task = asyncio.create_task(self._log_stats(), name=f"{self.name}-stats")

    async def _start_llm(self) -> None:
        from prometheus_client import CollectorRegistry
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        start = time.perf_counter()
        engine_args = self.config.make_engine_args()
        vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        configured = time.perf_counter()
        registry = CollectorRegistry()
        # AsyncLLM's constructor blocks until EngineCore is ready; keep the loop free meanwhile. A thread per build,
        # ending with it: no idle thread stays in the API process.
        builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-build")
        built = None
        try:
            # The EngineCores (spawned while AsyncLLM is built, also on a restart) take this replica's devices and
            # OpenMP CPU set; other stages start theirs once these exist, not once they are ready.
            async with spawn_environ(self.config.spawn_env(self.replica_id)) as started:
                built = builder.submit(self._build_llm, AsyncLLM, vllm_config, engine_args, registry)
                builder.shutdown(wait=False)
                self._building = built
                await started(asyncio.wrap_future(built), vllm_config.parallel_config.data_parallel_size_local)
            llm = await asyncio.wait_for(asyncio.wrap_future(built), timeout=self.config.stage_init_timeout)
        except BaseException:
            # AsyncLLM's constructor blocks until EngineCore is ready and cannot be interrupted: if we stop
            # waiting (timeout, cancel) whatever it builds is shut down once built.
            if built is not None and self._building is built:  # not taken over by `shutdown`
                self._building = None
                built.add_done_callback(_discard_built)
            raise
        if self._building is not built:  # `shutdown` ran meanwhile and shut it down
            raise EngineDeadError(f"{self.name}: shut down while its EngineCore started")
        self._building = None
        self.llm = llm
        self.llm_builds += 1
        # vLLM's EngineCore logs its own phases (weights; profile, KV cache and warm-up) from its process.
        self.startup_phases = {"vLLM config": configured - start, "EngineCore": time.perf_counter() - configured}
        self._core_segments = _engine_core_segments(self.llm)
        self.metrics_registry = registry

    async def _log_stats(self) -> None:
        """vLLM's periodic throughput / KV-cache log line, which `vllm serve` drives from its API server."""
        from vllm import envs

        while not self._dead:
            await asyncio.sleep(envs.VLLM_LOG_STATS_INTERVAL)
            if self.llm is not None and not self.is_restarting:
                await self.llm.do_log_stats()

    @staticmethod
    def _build_llm(async_llm_cls: Any, vllm_config: Any, engine_args: Any, registry: Any) -> Any:
        from vllm_omni.engine.stage_metrics import stage_prometheus_logger

        return async_llm_cls.from_vllm_config(vllm_config, disable_log_stats=engine_args.disable_log_stats,
                                              stat_loggers=[stage_prometheus_logger(registry)])

    def _live_llm(self) -> Any:
        """The AsyncLLM; while it is being re-created there is none, and a request asking for its tokenizer or
        config then gets the stage's 503, not an AttributeError."""
        if self.llm is None:
            if self._dead:
                raise EngineDeadError(f"{self.name}: EngineCore died")
            raise StageRestartingError(f"{self.name}: the EngineCore died and is being re-created")
        return self.llm

    @property
    def vllm_config(self):
        return self._live_llm().vllm_config

    def get_tokenizer(self):
        return self._live_llm().get_tokenizer()

    def default_sampling_params(self) -> Any:
        from vllm import SamplingParams

        defaults = self._live_llm().model_config.get_diff_sampling_param() or {}
        defaults.update(self.config.default_sampling_params)
        return SamplingParams.from_optional(**defaults) if defaults else SamplingParams()

    @property
    def output_modality(self) -> str:
        return self.config.final_output_type or "text"

    @property
    def input_modalities(self) -> frozenset[Modality]:
        """The family spec's declaration for a topology we define (e.g. Qwen3-Omni); text for any other LM."""
        from vllm_omni.catalog.registry import MODEL_REGISTRY

        spec = MODEL_REGISTRY.family_for(list(self.vllm_config.model_config.architectures))
        return spec.input_modalities if spec is not None else frozenset({"text"})

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        if not isinstance(sampling_params, SamplingParams):
            raise OmniClientError(f"stage {self.stage_id} is an AR stage and needs vLLM SamplingParams, got "
                                  f"{type(sampling_params).__name__}", param="sampling_params_list")
        if self.is_restarting:
            raise StageRestartingError(f"{self.name}: the EngineCore died and is being re-created")
        start = time.perf_counter()
        result, finished, stage_data = None, False, {}
        try:
            async for out in self.llm.generate(prompt, sampling_params, request_id):
                if out.kv_transfer_params and STAGE_DATA_KEY in out.kv_transfer_params:
                    stage_data = {**stage_data, **out.kv_transfer_params[STAGE_DATA_KEY]}
                completion = out.outputs[0] if out.outputs else None
                result = OmniRequestOutput(
                    request_id=request_id,
                    finished=out.finished,
                    stage_id=self.stage_id,
                    final_output_type=self.output_modality,
                    text=completion.text if completion else None,
                    token_ids=list(completion.token_ids) if completion else [],
                    request_output=out,
                    stage_data=stage_data,
                )
                aborted = out.finished and completion is not None and completion.finish_reason == "abort"
                if aborted and not self.final_output:  # a truncated intermediate result must not feed on
                    raise EngineGenerateError(f"{self.name}: request {request_id} was aborted by the engine")
                if out.finished:
                    await self._finish(request_id, result, start)
                finished = out.finished  # (the receiver may change `result`)
                yield result
            if result is not None and not finished:
                # A streaming-input request whose input closed while it waited ends without a finished output.
                result = OmniRequestOutput(request_id=request_id, finished=True, stage_id=self.stage_id,
                                           final_output_type=self.output_modality, text=result.text,
                                           request_output=result.request_output, stage_data=stage_data)
                await self._finish(request_id, result, start)
                yield result
        except VllmEngineDeadError as e:
            raise self._engine_died() from e
        except (VLLMClientError, ValueError) as e:  # vLLM input validation (prompt too long, bad params, ...)
            if self.llm.errored:
                raise self._engine_died() from e
            raise OmniClientError(f"stage {self.stage_id}: {e}", param=getattr(e, "parameter", None)) from e

    async def _finish(self, request_id: str, result: OmniRequestOutput, start: float) -> None:
        if self.config.output_collector is not None:
            collect = get_output_collector(self.config.output_collector)
            result.multimodal_output["stage_data"] = await collect(self, request_id, result)
        elapsed = time.perf_counter() - start
        result.stage_durations.update(self.stage_durations(elapsed))

    def _engine_died(self) -> Exception:
        """The error for requests the dead EngineCore ran; starts the restart when the budget allows."""
        self._begin_restart()
        if self.is_restarting:
            return StageRestartingError(f"{self.name}: the EngineCore died; the stage is re-creating it")
        return EngineDeadError(f"{self.name}: EngineCore died")

    async def _watch(self) -> None:
        """Notice a death no request is waiting on (vLLM's own monitor sets `errored`)."""
        while not self._dead:
            if self.llm.errored:
                self._begin_restart()
                if self._restart_task is not None:
                    await asyncio.shield(self._restart_task)
            await asyncio.sleep(_DEATH_POLL_INTERVAL_S)

    def _begin_restart(self) -> None:
        if self.is_restarting or self._dead or not self.llm.errored:
            return
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        # vLLM fails a dead EngineCore's requests from its output handler, a moment after `errored` turns true;
        # the shutdown below cancels that handler, so the stage fails them first (else they wait for their
        # client's timeout).
        self.llm.output_processor.propagate_error(VllmEngineDeadError())
        if self._restarts >= self.config.max_stage_restarts:
            logger.error("[%s] EngineCore died; restart budget (%d) spent, the stage is dead", self.name,
                         self.config.max_stage_restarts)
            self._dead = True
            self._shutdown_llm()
            return
        self._restarts += 1
        self._restart_task = asyncio.create_task(self._restart(), name=f"{self.name}-restart")

    async def _restart(self) -> None:
        logger.warning("[%s] EngineCore died; re-creating it (restart %d of %d)", self.name, self._restarts,
                       self.config.max_stage_restarts)
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown_llm)
        try:
            await self._start_llm()
        except Exception:
            logger.exception("[%s] re-creating the EngineCore failed; the stage is dead", self.name)
            self._dead = True
            return
        logger.info("[%s] EngineCore re-created in %.1f s", self.name, sum(self.startup_phases.values()))

    def _shutdown_llm(self) -> None:
        """vLLM's shutdown of the AsyncLLM (reaps the EngineCore); then the shared memory that EngineCore
        created, which a killed EngineCore never unlinks (the resource tracker would only at server exit)."""
        # Dropped before its shutdown: a reference kept until interpreter exit runs AsyncLLM.__del__ (another
        # shutdown) after module globals are cleared ("Exception ignored ... TypeError").
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        for name in self._core_segments:
            _unlink_segment(name)
        self._core_segments = set()

    async def abort(self, request_ids: list[str]) -> None:
        if not self.is_restarting and not self.llm.errored:
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
        return self._dead

    @property
    def is_restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    def shutdown(self) -> None:
        self._dead = True
        for task in (self._watch_task, self._restart_task, self._stats_task):
            if task is not None:
                cancel_task(task)
        building, self._building = self._building, None
        if building is not None:  # mid-restart: wait for the EngineCore being started, then shut it down
            try:
                _discard(building.result(timeout=_SHUTDOWN_TIMEOUT_S))
            except FutureTimeoutError:
                logger.warning("[%s] the EngineCore being started was not ready within %.0f s of shutdown; "
                               "it is shut down once it is", self.name, _SHUTDOWN_TIMEOUT_S)
                building.add_done_callback(_discard_built)
            except Exception:  # the build failed: nothing to shut down
                pass
        self._shutdown_llm()


def _discard(llm: Any) -> None:
    """Shut down an AsyncLLM the stage never adopted, and free its EngineCore's shared memory."""
    segments = _engine_core_segments(llm)
    llm.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
    for name in segments:
        _unlink_segment(name)


def _discard_built(built: Future) -> None:
    if not built.cancelled() and built.exception() is None:
        _discard(built.result())


def _engine_core_segments(llm) -> set[str]:
    """The /dev/shm segments this AsyncLLM's EngineCore processes (and their workers) map."""
    import psutil

    manager = getattr(llm.engine_core.resources, "engine_manager", None)
    pids = [p.pid for p in getattr(manager, "processes", [])]
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            core = psutil.Process(pid)
            procs += [core, *core.children(recursive=True)]
    names: set[str] = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            names.update(m.path.removeprefix("/dev/shm/") for m in proc.memory_maps()
                         if m.path.startswith("/dev/shm/"))
    return names


def _unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()  # also tells the resource tracker it is gone


def _utility_args(method: str, args: tuple, kwargs: dict[str, Any] | None) -> tuple:
    """EngineCore utility calls carry positional arguments only: keywords go to their positions by the
    method's signature (a bad name is a TypeError here, not a wrong value over there)."""
    if not kwargs:
        return tuple(args)
    from vllm.v1.engine.core import EngineCore

    bound = inspect.signature(getattr(EngineCore, method)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:]
