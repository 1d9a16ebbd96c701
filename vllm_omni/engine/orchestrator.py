"""Cross-stage request lifecycle: admission, the walk of each request through the stage graph (a task on the
caller's loop, as vLLM's `AsyncLLM` runs on its caller's), abort, control RPC and the stages' liveness.

The graph is `stage_graph.py`, the walk and its edge drivers `edges.py`. It never picks models or placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.engine.edges import OutputSink, RequestState, RequestWalk
from vllm_omni.engine.stage_graph import StageGraph
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.errors import EngineDeadError, EngineGenerateError, OmniClientError, OmniError, StageRestartingError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

DEATH_POLL_INTERVAL_S = 0.5


class Orchestrator:
    def __init__(self, stage_pools: list[StagePool], config: VllmOmniConfig, stage_modalities: list[str]) -> None:
        """`stage_modalities`: the output modality of each stage (for requests that ask for some of them)."""
        self.stage_pools = stage_pools
        self.graph = StageGraph(config, stage_modalities)
        self.request_states: dict[str, RequestState] = {}
        self.dead_error: str | None = None
        self._monitor: asyncio.Task | None = None
        self._aborting: set[asyncio.Task] = set()
        """Aborts nobody waits for (kept referenced until they end)."""

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start_monitor(self) -> None:
        """Watch the stages' liveness from the running loop (the one that drives the stages)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._monitor_stages(), name="omni-stage-monitor")

    def close(self) -> None:
        """Stop every request and the monitor, and free the connectors (on the loop, or after it ended)."""
        for task in [state.task for state in self.request_states.values()] + [self._monitor]:
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed: it will never run again
                    task.cancel()
        self.request_states.clear()
        self.graph.close()

    def add_request(self, request_id: str, prompt: Any, sampling_params_list: list[Any], sink: OutputSink,
                    output_modalities: list[str] | None = None, arrival_time: float | None = None) -> None:
        """Start the request on the running loop; its outputs (or its error) go to `sink`."""
        rid = request_id
        if self.dead_error is not None:
            sink(EngineDeadError(self.dead_error))
            return
        if rid in self.request_states:
            sink(OmniClientError(f"request id {rid!r} is already in flight", param="request_id"))
            return
        if len(sampling_params_list) != len(self.stage_pools):
            sink(OmniClientError(
                f"sampling_params_list has {len(sampling_params_list)} entries but the pipeline has "
                f"{len(self.stage_pools)} stages", param="sampling_params_list"))
            return
        state = RequestState(rid, sink, arrival_time=arrival_time or time.time())
        self.request_states[rid] = state
        state.task = asyncio.create_task(self._run_request(state, prompt, list(sampling_params_list),
                                                           output_modalities))

    async def _run_request(self, state: RequestState, prompt: Any, params_list: list[Any],
                           output_modalities: list[str] | None) -> None:
        rid = state.request_id
        try:
            walk = RequestWalk(self.graph, self.stage_pools, state, prompt, params_list,
                               self.graph.last_stage(output_modalities))
            await walk.run()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._mark_dead(str(e))
            state.sink(e)
        except Exception as e:
            logger.info("[Orchestrator] request %s failed in stage %d: %s", rid, state.current_stage, e)
            state.sink(_request_error(e))
        finally:
            self.graph.drop_request(rid)
            if self.request_states.get(rid) is state:
                del self.request_states[rid]

    # ---- abort -----------------------------------------------------------------------------------------
    async def abort(self, request_ids: list[str]) -> None:
        """Free the requests in every stage that holds them; return once each stage has (raises otherwise)."""
        await self._cleanup_request_ids(list(request_ids), abort=True)
        logger.debug("[Orchestrator] Aborted request(s) %s", request_ids)

    def abort_soon(self, request_ids: list[str]) -> None:
        """`abort` in a task of its own (the caller cannot wait: its own task is being cancelled)."""
        task = asyncio.create_task(self._abort_logged(request_ids))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort_logged(self, request_ids: list[str]) -> None:
        try:
            await self.abort(request_ids)
        except Exception:
            logger.exception("[Orchestrator] Abort failed for request(s) %s", request_ids)

    async def _cleanup_request_ids(self, request_ids: list[str], *, abort: bool = False) -> None:
        """Stop the requests' tasks, free them in every stage that holds them and drop their payloads."""
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            if abort:
                for pool in self.stage_pools:
                    if pool.active_replica(rid) is not None:
                        await pool.abort([rid])
            if state is not None and state.task is not None:
                state.task.cancel()
            self.graph.drop_request(rid)

    # ---- control RPC and liveness ----------------------------------------------------------------------
    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None,
                             stage_ids: list[int] | None = None) -> dict[int, list[Any]]:
        """Stage id -> one result per replica (the method's return value, or a `StageRpcError`)."""
        stage_ids = stage_ids if stage_ids is not None else list(range(len(self.stage_pools)))
        results = await asyncio.gather(*(self.stage_pools[sid].collective_rpc_all(method, timeout, args, kwargs)
                                         for sid in stage_ids))
        return dict(zip(stage_ids, results, strict=True))

    async def _monitor_stages(self) -> None:
        while self.dead_error is None:
            for pool in self.stage_pools:
                if pool.is_dead:
                    self._mark_dead(f"stage {pool.stage_id} ({pool.kind.stage_type}) died")
                    break
            await asyncio.sleep(DEATH_POLL_INTERVAL_S)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = reason
        logger.error("[Orchestrator] engine is dead: %s", reason)
        for state in list(self.request_states.values()):
            if state.task is not None:
                state.task.cancel()
            state.sink(EngineDeadError(reason))
        self.request_states.clear()


def _request_error(exc: BaseException) -> BaseException:
    """What the caller of a failed request gets: client errors (with their field), the engine's death, a
    restarting stage's 503 as they are; any other failure as the request's own 500."""
    if isinstance(exc, OmniClientError | EngineDeadError | StageRestartingError | EngineGenerateError):
        return exc
    message = str(exc) or type(exc).__name__
    status = exc.status_code if isinstance(exc, OmniError) else 500
    if 400 <= status < 500:
        return OmniClientError(message, status_code=status, param=getattr(exc, "param", None))
    if status == StageRestartingError.status_code:
        return StageRestartingError(message)
    return EngineGenerateError(message)
