"""Composition root: resolves nothing, owns everything.

Starts a background thread running the Orchestrator's event loop, and talks to it through two queues and a
hand-off: requests in, RPC results out (correlated by `CorrelatedRpcClient`), outputs out in batches
(`OutputHandOff`: one wake-up of the frontend's loop per orchestrator loop iteration, not per token).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from typing import Any

import janus

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.engine.messages import (
    AbortRequestMessage,
    AbortResultMessage,
    AddRequestMessage,
    CollectiveRPCRequestMessage,
    CollectiveRPCResultMessage,
    ErrorMessage,
    ShutdownMessage,
)
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.engine.output_handoff import OutputHandOff
from vllm_omni.engine.rpc_result_router import CorrelatedRpcClient
from vllm_omni.engine.stage_runtime import StageClientFactory, StageRuntime, make_stage_client
from vllm_omni.logger import init_logger
from vllm_omni.plugins import ENGINE_CORE_FORKS_WORKERS

logger = init_logger(__name__)

SHUTDOWN_JOIN_TIMEOUT_S = 60.0


class AsyncOmniEngine:
    def __init__(self, config: VllmOmniConfig, *, request_queue_size: int = 0,
                 stage_client_factory: StageClientFactory | None = None) -> None:
        # Stage processes are started from a thread of a process that runs several threads: fork is unsafe.
        # Where the user chose no start method, their EngineCores may fork their own workers (plugins.py).
        if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ[ENGINE_CORE_FORKS_WORKERS] = "1"
        self.config = config
        self.request_queue: janus.Queue[Any] = janus.Queue(maxsize=request_queue_size)
        self.output_queue = OutputHandOff()
        self.rpc_output_queue: janus.Queue[Any] = janus.Queue()
        self.stage_clients: list[Any] = []
        self.stage_metadata: list[dict[str, Any]] = []
        self.capabilities: ModelCapabilities | None = None
        """Set once the stages are up (what the served model can do, for the HTTP layer)."""
        self.orchestrator: Orchestrator | None = None
        self._runtime = StageRuntime(config, stage_client_factory or make_stage_client)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._closed = False
        self._thread = threading.Thread(target=self._run_loop, name="OmniOrchestrator", daemon=True)
        start = time.perf_counter()
        self._thread.start()
        timeout = config.init_timeout or sum(s.stage_init_timeout * s.num_replicas for s in config.stages) + 30.0
        try:
            self._ready.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise RuntimeError(f"engine did not become ready within {timeout:.0f} s") from None
        except BaseException:
            self.shutdown()
            raise
        self._correlated_rpc_client = CorrelatedRpcClient(self.request_queue.sync_q, self.rpc_output_queue.sync_q)
        logger.info("[AsyncOmniEngine] %d stage(s) %s ready in %.1f s", len(config.stages), config.stage_types,
                    time.perf_counter() - start)

    # ---- background loop -------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        try:
            pools = await self._runtime.start()
        except BaseException as e:
            self._ready.set_exception(e)
            return
        try:
            self.stage_clients = [pool.clients[0] for pool in pools]
            self.stage_metadata = [self._describe(client) for client in self.stage_clients]
            self.capabilities = self._capabilities()
            self.orchestrator = Orchestrator(self.request_queue.async_q, self.output_queue,
                                             self.rpc_output_queue.sync_q, pools, self.config,
                                             stage_modalities=[m["output_modality"] for m in self.stage_metadata])
        except BaseException as e:
            await self._runtime.shutdown_async()
            self._ready.set_exception(e)
            return
        self._ready.set_result(None)
        try:
            await self.orchestrator.run()
        except Exception as e:
            # Waiters must not hang on a loop that is gone: tell every frontend and RPC caller.
            logger.exception("[AsyncOmniEngine] orchestrator loop crashed")
            self.orchestrator.dead_error = f"orchestrator crashed: {type(e).__name__}: {e}"
            fatal = ErrorMessage(error=self.orchestrator.dead_error, fatal=True, status_code=503,
                                 error_type="EngineDeadError")
            self.output_queue.put_nowait(fatal)
            self.rpc_output_queue.sync_q.put(fatal)
        finally:
            self.output_queue.flush()  # the loop ends with this coroutine: send what it would have sent
            await self._runtime.shutdown_async()

    def _capabilities(self) -> ModelCapabilities:
        entry = [c for c, stage in zip(self.stage_clients, self.config.stages, strict=True) if not stage.inputs]
        rules = tuple(c.shape_rule for c in self.stage_clients)
        return ModelCapabilities(
            stage_kinds=tuple(c.kind for c in self.stage_clients),
            input_modalities=frozenset().union(*(c.input_modalities for c in entry)),
            output_modalities=frozenset(c.output_modality for c in self.stage_clients if c.final_output),
            shape_rules=rules if any(rules) else ())

    @staticmethod
    def _describe(client: Any) -> dict[str, Any]:
        return {
            "stage_id": client.stage_id,
            "stage_kind": client.kind,
            "stage_type": client.stage_type,
            "final_output": client.final_output,
            "output_modality": client.output_modality,
            "default_sampling_params": client.default_sampling_params(),
        }

    # ---- frontend API (thread-safe) ----------------------------------------------------------------------
    @property
    def stage_vllm_configs(self) -> list[Any]:
        return [getattr(c, "vllm_config", None) if c.kind is StageKind.AR else None for c in self.stage_clients]

    @property
    def is_dead(self) -> bool:
        orch = self.orchestrator
        return not self._thread.is_alive() or (orch is not None and orch.dead_error is not None)

    @property
    def restarting_stages(self) -> list[int]:
        """Stages with no serving replica that are starting new workers: requests to them wait or get 503."""
        return [pool.stage_id for pool in self._runtime.pools
                if not pool.is_serving and "restarting" in pool.replica_states()]

    def stage_health(self) -> list[dict[str, Any]]:
        """Per stage: its replicas' states and how many requests each was given (read by `/health`)."""
        return [{"stage_id": pool.stage_id, "stage_type": pool.kind.stage_type, "replicas": pool.replica_states(),
                 "dispatched": [pool.dispatched.get(i, 0) for i in range(len(pool.clients))]}
                for pool in self._runtime.pools]

    def stage_metrics_registries(self) -> list[tuple[int, str, int, Any]]:
        """(stage id, stage type, replica, registry) of every AR stage replica's vLLM `vllm:*` series (read at
        each scrape: a re-created EngineCore comes with a new registry)."""
        return [(pool.stage_id, pool.kind.stage_type, replica, registry) for pool in self._runtime.pools
                for replica, client in enumerate(pool.clients)
                if (registry := getattr(client, "metrics_registry", None)) is not None]

    @property
    def dead_error(self) -> str | None:
        if self.orchestrator is not None and self.orchestrator.dead_error is not None:
            return self.orchestrator.dead_error
        return None if self._thread.is_alive() else "the engine's orchestrator thread stopped"

    def run_in_loop(self, coro: Any) -> concurrent.futures.Future:
        """Run `coro` on the orchestrator's loop, where the stage clients live (vLLM's AsyncLLM is bound to
        the loop it started on)."""
        if self._loop is None or self._loop.is_closed():
            coro.close()
            raise RuntimeError("the engine's loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def add_request(self, request_id: str, prompt: Any, sampling_params_list: list[Any],
                    output_modalities: list[str] | None = None) -> None:
        self.request_queue.sync_q.put(AddRequestMessage(request_id=request_id, prompt=prompt,
                                                        sampling_params_list=list(sampling_params_list),
                                                        arrival_time=time.time(),
                                                        output_modalities=output_modalities))

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: the orchestrator frees the requests in every stage; no result is sent."""
        if self.request_queue is None:
            raise RuntimeError("request_queue is not initialized")
        self.request_queue.sync_q.put(AbortRequestMessage(request_ids=list(request_ids)))

    async def abort_async(self, request_ids: list[str], timeout: float | None = None) -> None:
        """Abort and wait for the orchestrator's acknowledgement (every stage freed the requests)."""
        client = getattr(self, "_correlated_rpc_client", None)
        if client is None:
            raise RuntimeError("correlated RPC client is not initialized")
        rpc_id = uuid.uuid4().hex
        msg = AbortRequestMessage(request_ids=list(request_ids), rpc_id=rpc_id)
        result = await asyncio.get_running_loop().run_in_executor(None, lambda: client.execute(
            ("abort", rpc_id), msg, timeout=timeout, timeout_message=f"abort timed out after {timeout} seconds",
            block_on_submit=True))
        if isinstance(result, ErrorMessage):
            raise RuntimeError(result.error)
        if not isinstance(result, AbortResultMessage):
            raise RuntimeError(f"unexpected abort result type: {type(result).__name__}")
        if not result.success:
            raise RuntimeError(result.error or "abort failed")

    async def collective_rpc_async(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                                   stage_ids: list[int] | None = None,
                                   timeout: float | None = None) -> dict[int, list[Any]]:
        rpc_id = uuid.uuid4().hex
        msg = CollectiveRPCRequestMessage(rpc_id=rpc_id, method=method, args=tuple(args), kwargs=kwargs,
                                          stage_ids=stage_ids, timeout=timeout)
        wait = None if timeout is None else timeout + 5.0
        result = await asyncio.get_running_loop().run_in_executor(None, lambda: self._correlated_rpc_client.execute(
            ("collective_rpc", rpc_id), msg, timeout=wait,
            timeout_message=f"collective_rpc {method} timed out after {wait} seconds"))
        if isinstance(result, ErrorMessage):
            raise RuntimeError(result.error)
        assert isinstance(result, CollectiveRPCResultMessage)
        if result.error is not None:
            raise RuntimeError(f"{method} failed: {result.error}")
        return result.results

    def shutdown(self) -> None:
        """Stop the orchestrator, shut the stages down (side by side) and join the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive() and self._ready.done() and self._ready.exception() is None:
            self.request_queue.sync_q.put(ShutdownMessage())
        self._thread.join(timeout=SHUTDOWN_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("[AsyncOmniEngine] orchestrator thread did not stop within %.0f s", SHUTDOWN_JOIN_TIMEOUT_S)
        client = getattr(self, "_correlated_rpc_client", None)
        if client is not None:
            client.close()
