"""DIFFUSION stage run in the engine's own process: `DiffusionEngine` (contract 3) behind the stage interface.

The engine's workers are separate processes; only the scheduler lives here, so no extra IPC hop is needed
for a one-stage diffusion pipeline. A request whose params set `stream_partial_outputs` also yields its
partials (denoise progress, decoded video chunks) as unfinished outputs before the final one; a streamed clip
crosses the worker boundary once, as its chunks, and its final output is joined from them here.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import Modality
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.video_utils import STREAMED_FRAMES, join_streamed_video
from vllm_omni.engine.spawn_env import spawn_environ
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.errors import EngineDeadError, client_error_from_metadata
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

_ABORT_WAIT_S = 3.0
"""How long an abort waits for the workers to leave the request: well inside the frontend's 10 s, and short
enough that a SIGTERM (3 s grace, this, then the executor's shutdown) still ends within 15 s."""


class InlineStageDiffusionClient(StageClientBase):
    kind = StageKind.DIFFUSION

    def __init__(self, config, replica_id: int = 0, engine: Any = None) -> None:
        super().__init__(config, replica_id)
        self._engine = engine
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"diffusion-stage{self.stage_id}")
        self._engine_dead = False
        self._shutting_down = False
        self._shutdown_complete = False
        self._shutdown_lock = threading.Lock()
        self._failure_callback_registered = False
        if engine is not None:
            self._register_failure_callback()

    async def start(self) -> None:
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

        od_config = self.config.make_od_config()
        building = None
        try:
            # The workers take this replica's devices; other stages start theirs once these processes exist.
            async with spawn_environ(self.config.spawn_env(self.replica_id)) as started:
                building = self._executor.submit(DiffusionEngine, od_config)
                await started(asyncio.wrap_future(building), od_config.parallel_config.world_size)
            self._engine = await asyncio.wait_for(asyncio.wrap_future(building),
                                                  timeout=self.config.stage_init_timeout)
        except BaseException:
            # The constructor cannot be interrupted: if we stop waiting (timeout, cancel), the engine it builds is
            # closed once built (in the thread that built it: this loop may be gone by then).
            if building is not None:
                building.add_done_callback(_close_built)
            raise
        self._register_failure_callback()
        self.startup_phases = _worker_startup_phases(self._engine.executor.worker_info)

    def _register_failure_callback(self) -> None:
        if not self._failure_callback_registered:
            self._engine.register_failure_callback(self._mark_engine_dead)
            self._failure_callback_registered = True

    def _mark_engine_dead(self, *_: Any) -> None:
        self._engine_dead = True

    @property
    def output_modality(self) -> str:
        return self.config.final_output_type or self._engine.output_modality

    @property
    def input_modalities(self) -> frozenset[Modality]:
        return self._engine.input_modalities

    @property
    def shape_rule(self) -> ShapeRule | None:
        return self._engine.shape_rule

    def default_sampling_params(self) -> OmniDiffusionSamplingParams:
        return OmniDiffusionSamplingParams.from_dict(dict(self.config.default_sampling_params))

    def _make_request(self, request_id: str, prompt: Any, sampling_params: Any):
        from vllm_omni.diffusion.request import OmniDiffusionRequest

        # Clone now: the caller may reuse one params object for many requests.
        params = OmniDiffusionSamplingParams.from_params(sampling_params).clone()
        return OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=request_id)

    async def add_request_async(self, request_id: str, prompt: Any, sampling_params: Any,
                                on_partial: Any = None) -> Any:
        """Submit one request; returns an asyncio future of its `DiffusionOutput`."""
        if self.is_dead:
            raise EngineDeadError(f"{self.name}: diffusion engine is dead")
        request = self._make_request(request_id, prompt, sampling_params)
        bound = self._engine.prompt_bound
        if bound is not None:  # tokenizing runs off the event loop; a prompt over the limit is a 400 here
            await asyncio.to_thread(bound.check, {"prompt": request.prompt_text,
                                                  "negative_prompt": request.negative_prompt})
        return asyncio.wrap_future(self._engine.submit(request, on_partial=on_partial))

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        start = time.perf_counter()
        params = OmniDiffusionSamplingParams.from_params(sampling_params)
        partials = _PartialStream(asyncio.get_running_loop()) if params.stream_partial_outputs else None
        future = await self.add_request_async(request_id, prompt, params,
                                              on_partial=None if partials is None else partials.put_threadsafe)
        chunks: list[Any] = []
        if partials is not None:
            # The future completes after the engine handed over the last partial, so this ends the stream last.
            future.add_done_callback(lambda _: partials.close())
            async for partial in partials:
                if partial.kind == "video_chunk":
                    chunks.append(partial.data["video"])
                yield self._partial_output(request_id, partial)
        try:
            result = await future
        except EngineDeadError:
            self._engine_dead = True
            raise
        if result.error is not None:
            raise client_error_from_metadata(result.error, status_code=result.error_status_code,
                                             error_type=result.error_type, param=result.error_param)
        if isinstance(result.output, dict) and STREAMED_FRAMES in result.output:
            result.output = await asyncio.to_thread(join_streamed_video, result.output, chunks)
        yield self._to_output(request_id, result, time.perf_counter() - start)

    def _partial_output(self, request_id: str, partial: Any) -> OmniRequestOutput:
        """`{"video_chunk": frames, "fps", "frame_start"}` or `{"progress": {"step", "total"}}`, unfinished."""
        out = OmniRequestOutput(request_id=request_id, finished=False, stage_id=self.stage_id,
                                final_output_type=self.output_modality)
        data = dict(partial.data)
        if partial.kind == "video_chunk":
            out.multimodal_output = {"video_chunk": data.pop("video"), **data}
        else:
            out.multimodal_output = {partial.kind: data}
        return out

    def _to_output(self, request_id: str, result: Any, elapsed: float) -> OmniRequestOutput:
        modality = self.output_modality
        out = OmniRequestOutput(request_id=request_id, finished=True, stage_id=self.stage_id,
                                final_output_type=modality, peak_memory_mb=result.peak_memory_mb,
                                cache=result.extra.get("cache"), step_stats=result.step_stats,
                                compile_stats=result.compile_stats)
        if isinstance(result.output, dict):
            out.multimodal_output = dict(result.output)
        elif modality == "image":
            out.images = list(result.output or [])
        else:
            out.multimodal_output = {modality: result.output}
        out.stage_durations = self.stage_durations(elapsed, result.stage_durations)
        return out

    async def abort(self, request_ids: list[str]) -> None:
        """Returns once the workers stopped running the requests (or after `_ABORT_WAIT_S`), so that what
        the frontend counts as running is what the workers run."""
        if self.is_dead:
            return
        self._engine.abort(list(request_ids))
        stopped = await asyncio.get_running_loop().run_in_executor(
            None, self._engine.wait_stopped, list(request_ids), _ABORT_WAIT_S)
        if not stopped:
            logger.warning("%s: aborted request(s) %s still ran on the workers after %.0f s", self.name,
                           request_ids, _ABORT_WAIT_S)

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self._engine.collective_rpc(method, tuple(args), kwargs, timeout))

    @property
    def is_dead(self) -> bool:
        return self._engine_dead or (self._engine is not None and self._engine.is_dead)

    @property
    def is_restarting(self) -> bool:
        return self._engine is not None and self._engine.is_restarting

    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shutdown_complete:
                return
            self._shutting_down = True
            if self._engine is not None:
                self._engine.close()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._shutdown_complete = True


def _close_built(building: Future) -> None:
    if not building.cancelled() and building.exception() is None:
        building.result().close()


def _worker_startup_phases(worker_info: list[dict[str, Any]]) -> dict[str, float]:
    """The slowest rank's seconds per start-up phase (the stage is ready when its last rank is)."""
    phases: dict[str, float] = {}
    for info in worker_info:
        for name, seconds in info.get("startup_s", {}).items():
            phases[name] = max(phases.get(name, 0.0), seconds)
    return phases


class _PartialStream:
    """One request's partials, handed from the engine's result thread to the event loop.

    The producer never waits (the worker and the result thread must not stall on a slow consumer). While the
    consumer lags, a newer progress report replaces a pending older one; video chunks are never dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Any] = deque()
        self._wakeup = asyncio.Event()
        self._closed = False

    def put_threadsafe(self, partial: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens any more
            self._loop.call_soon_threadsafe(self._put, partial)

    def _put(self, partial: Any) -> None:
        if partial.kind == "progress" and self._items and self._items[-1].kind == "progress":
            self._items[-1] = partial
        else:
            self._items.append(partial)
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            while self._items:
                yield self._items.popleft()
            if self._closed:
                return
            self._wakeup.clear()
            await self._wakeup.wait()
