"""Async frontend: streaming `generate`, acknowledged abort, pause/resume and sleep/wake routed by stage type.

Admission: `pause_generation` and AR `sleep` close admission until `resume_generation`; a diffusion-only
sleep closes it until `wake_up`. New `generate` calls wait while admission is closed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import AckMetadata, CuMemTag, OmniACK, PauseMode, StageRpcError
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.errors import EngineDeadError, OmniClientError, StageRestartingError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

ABORT_TIMEOUT_S = 10.0
ALL_TAGS = frozenset({CuMemTag.WEIGHTS, CuMemTag.KV_CACHE})
_ABORTED = object()
"""Ends an aborted request's stream quietly (the caller asked for it)."""


class _RequestState:
    """One request's outputs not yet read, in order. Nothing is merged: a streaming caller gets every output
    (one SSE chunk per token), unlike vLLM's RequestOutputCollector, which merges when its reader lags."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class AsyncOmni(OmniBase):
    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.request_states: dict[str, _RequestState] = {}
        self._pause_cond: asyncio.Condition | None = None
        self._paused = False
        self._hold_admission_until_resume = False
        self._sleeping_tags: set[str] = set()
        self._level2_sleeping = False

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.engine.is_dead

    @property
    def is_sleeping(self) -> bool:
        """Some stage is asleep (`sleep` without the matching `wake_up`): generation would wait for a wake-up."""
        return bool(self._sleeping_tags)

    @property
    def errored(self) -> bool:
        return self.engine.is_dead

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"engine is dead: {self.engine.dead_error}")

    async def check_health(self) -> None:
        """Raises while the engine is dead, or while a stage has no serving replica because it is restarting
        its workers (503 until back). A stage with another replica serving is degraded, not unhealthy."""
        self.engine.bind_loop()
        if self.engine.is_dead:
            raise self.dead_error
        if restarting := self.engine.restarting_stages:
            raise StageRestartingError(f"degraded: stage(s) {restarting} are restarting their workers")

    def stage_health(self) -> list[dict[str, Any]]:
        """Per stage: its replicas' states ("serving", "restarting", "dead") and requests given to each."""
        return self.engine.stage_health()

    def degraded_stages(self) -> list[dict[str, Any]]:
        """The stages with a replica that does not serve (dead or restarting), as `stage_health` reports them."""
        return [stage for stage in self.stage_health() if any(r != "serving" for r in stage["replicas"])]

    def is_paused(self) -> bool:
        return self._paused

    def _cond(self) -> asyncio.Condition:
        if self._pause_cond is None:
            self._pause_cond = asyncio.Condition()
        return self._pause_cond

    # ---- generate / abort --------------------------------------------------------------------------------
    async def generate(self, prompt: Any, request_id: str, sampling_params_list: Any = None, *,
                       sampling_params: Any = None, output_modalities: list[str] | None = None
                       ) -> AsyncIterator[OmniRequestOutput]:
        """Stream the request's outputs (partial text from streaming AR stages, then final media).

        `output_modalities` (e.g. ["text"]) stops the request after the last stage making one of them."""
        self.engine.bind_loop()
        if sampling_params_list is None and sampling_params is not None:
            sampling_params_list = sampling_params
        params = self._resolve_sampling_params(sampling_params_list)
        async with self._cond():
            await self._cond().wait_for(lambda: not self._paused)
        await self.check_health()
        if request_id in self.request_states:
            raise OmniClientError(f"request id {request_id!r} is already in flight", param="request_id")
        state = _RequestState(request_id)
        self.request_states[request_id] = state
        self.engine.add_request(request_id, prompt, params, state.put, output_modalities)
        finished = False
        try:
            while not finished:
                item = await state.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self.engine.abort_soon([request_id])
            raise
        finally:
            if self.request_states.get(request_id) is state:
                del self.request_states[request_id]

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort and wait for the engine's ack; the frontend state is dropped only after the ack."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._abort(ids)

    async def _abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids, timeout=ABORT_TIMEOUT_S)
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            if state is not None:
                state.put(_ABORTED)

    # ---- control RPC ------------------------------------------------------------------------------------
    def _validate_stage_ids(self, stage_ids: list[int] | None) -> list[int]:
        n = self.num_stages
        if n == 0:
            raise ValueError("this engine has no stages")
        if stage_ids is None:
            return list(range(n))
        bad = [s for s in stage_ids if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n]
        if bad:
            raise OmniClientError(f"Invalid stage_ids {bad}; valid range is 0..{n - 1}", param="stage_ids")
        return list(stage_ids)

    def _split_stage_ids_by_type(self, stage_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(AR ids, diffusion ids); a GENERATION stage (a small in-process model) has no scheduler to pause and
        no EngineCore memory to release, so control calls skip it."""
        ids = self._validate_stage_ids(stage_ids)
        kinds = self.stage_kinds
        return ([i for i in ids if kinds[i] is StageKind.AR], [i for i in ids if kinds[i] is StageKind.DIFFUSION])

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None, stage_ids: list[int] | None = None) -> list[Any]:
        """Call `method` on every replica of the given stages; one result per replica, in stage order."""
        ids = self._validate_stage_ids(stage_ids)
        results = await self.engine.collective_rpc_async(method, tuple(args), kwargs, ids, timeout)
        return [r for sid in ids for r in results.get(sid, [])]

    async def _engine_core_rpc(self, method: str, *, stage_ids: list[int], args: tuple = (),
                               kwargs: dict[str, Any] | None = None) -> list[Any]:
        results = await self.collective_rpc(method=method, args=args, kwargs=kwargs, stage_ids=stage_ids)
        for result in results:
            if isinstance(result, StageRpcError):
                raise RuntimeError(f"{method} failed: {result.error}")
        return results

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = True) -> bool:
        ar_ids, _ = self._split_stage_ids_by_type()
        if not ar_ids:
            return True
        results = await self._engine_core_rpc("reset_prefix_cache", stage_ids=ar_ids,
                                              args=(reset_running_requests, reset_connector))
        return all(r is None or bool(r) for r in results)  # EngineCore answers a bool (None: nothing to do)

    async def reset_mm_cache(self) -> None:
        ar_ids, _ = self._split_stage_ids_by_type()
        if ar_ids:
            await self._engine_core_rpc("reset_mm_cache", stage_ids=ar_ids)

    async def reset_encoder_cache(self) -> None:
        ar_ids, _ = self._split_stage_ids_by_type()
        if ar_ids:
            await self._engine_core_rpc("reset_encoder_cache", stage_ids=ar_ids)

    # ---- pause / resume ----------------------------------------------------------------------------------
    async def pause_generation(self, *, mode: PauseMode = "abort", wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True, stage_ids: list[int] | None = None) -> None:
        if wait_for_inflight_requests:
            mode = "wait"
        ar_ids, _ = self._split_stage_ids_by_type(stage_ids)
        async with self._cond():
            self._paused = True
            self._hold_admission_until_resume = True
        if ar_ids:
            await self._engine_core_rpc("pause_scheduler", stage_ids=ar_ids,
                                        kwargs={"mode": mode, "clear_cache": clear_cache})
        if clear_cache:
            await self.reset_prefix_cache(reset_running_requests=not wait_for_inflight_requests,
                                          reset_connector=True)
            await self.reset_mm_cache()
            await self.reset_encoder_cache()

    async def resume_generation(self, stage_ids: list[int] | None = None) -> None:
        ar_ids, _ = self._split_stage_ids_by_type(stage_ids)
        if ar_ids:
            await self._engine_core_rpc("resume_scheduler", stage_ids=ar_ids)
        async with self._cond():
            self._paused = False
            self._hold_admission_until_resume = False
            self._cond().notify_all()

    # ---- sleep / wake ------------------------------------------------------------------------------------
    async def sleep(self, stage_ids: list[int] | None = None, level: int = 2,
                    mode: PauseMode = "abort") -> list[OmniACK]:
        ar_ids, diffusion_ids = self._split_stage_ids_by_type(stage_ids)
        async with self._cond():
            self._paused = True
            if ar_ids:
                self._hold_admission_until_resume = True
        acks: list[OmniACK] = []
        if ar_ids:
            await self._engine_core_rpc("sleep", stage_ids=ar_ids, args=(level, mode))
            acks += [OmniACK(task_id=f"engine_core-sleep-{uuid.uuid4().hex[:8]}", status="SUCCESS", stage_id=sid,
                             rank=0, metadata=AckMetadata(path="engine_core", level=level, mode=mode))
                     for sid in ar_ids]
        if diffusion_ids:
            acks += await self._sleep_diffusion(diffusion_ids, level)
        self._sleeping_tags |= ALL_TAGS
        self._level2_sleeping = self._level2_sleeping or level >= 2
        return acks

    async def _sleep_diffusion(self, stage_ids: list[int], level: int) -> list[OmniACK]:
        acks = []
        for sid in stage_ids:
            await self._engine_core_rpc("sleep", stage_ids=[sid], args=(level,))
            acks.append(OmniACK(task_id=f"diffusion-sleep-{uuid.uuid4().hex[:8]}", status="SUCCESS", stage_id=sid,
                                rank=0, metadata=AckMetadata(path="worker", level=level)))
        return acks

    async def wake_up(self, stage_ids: list[int] | None = None, tags: list[str] | None = None) -> list[OmniACK]:
        ar_ids, diffusion_ids = self._split_stage_ids_by_type(stage_ids)  # bad ids are an error even when warm
        requested = set(tags) if tags else set(ALL_TAGS)
        to_wake = requested & self._sleeping_tags
        if not to_wake:
            logger.info("Requested tags %s are already warm. Skipping wake_up.", sorted(requested))
            return []
        acks: list[OmniACK] = []
        if ar_ids:
            await self._engine_core_rpc("wake_up", stage_ids=ar_ids, kwargs={"tags": sorted(to_wake)})
            acks += [OmniACK(task_id=f"engine_core-wake-{uuid.uuid4().hex[:8]}", status="SUCCESS", stage_id=sid,
                             rank=0, metadata=AckMetadata(path="engine_core", tags=sorted(to_wake)))
                     for sid in ar_ids]
        if diffusion_ids:
            acks += await self._wake_diffusion(diffusion_ids, to_wake)
        self._sleeping_tags -= to_wake
        if not self._sleeping_tags:
            self._level2_sleeping = False
            if not self._hold_admission_until_resume:
                async with self._cond():
                    self._paused = False
                    self._cond().notify_all()
        return acks

    async def _wake_diffusion(self, stage_ids: list[int], requested_tags: set[str]) -> list[OmniACK]:
        acks = []
        for sid in stage_ids:
            await self._engine_core_rpc("wake_up", stage_ids=[sid], args=(sorted(requested_tags),))
            acks.append(OmniACK(task_id=f"diffusion-wake-{uuid.uuid4().hex[:8]}", status="SUCCESS", stage_id=sid,
                                rank=0, metadata=AckMetadata(path="worker", tags=sorted(requested_tags))))
        return acks

    def shutdown(self) -> None:
        self.close()

