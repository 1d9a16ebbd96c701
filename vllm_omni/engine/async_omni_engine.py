"""Composition root: starts the stages, then drives them from the caller's event loop (as vLLM's `AsyncLLM`).

The constructor blocks until every stage is ready, as AsyncLLM's does, and may be called from inside a running
loop (the server's): the stages start on a short-lived loop of a start-up thread that ends with it. From then
on everything runs on the loop that first uses the engine: the Orchestrator's request tasks and stage monitor,
and each stage client's own tasks (`StageClientBase.on_loop`). No thread of ours sits between the caller and
the stages, and no message queue: requests are calls, outputs go to the sink each request was given.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from typing import Any

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.engine.edges import OutputSink
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.engine.stage_runtime import StageClientFactory, StageRuntime, make_stage_client
from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

START_JOIN_GRACE_S = 30.0
"""How long past the readiness timeout the start-up thread may take to shut down what it started."""


class AsyncOmniEngine:
    def __init__(self, config: VllmOmniConfig, *, stage_client_factory: StageClientFactory | None = None,
                 prestarted_core: PrestartedCore | None = None) -> None:
        """`prestarted_core`: a diffusion core process forked ahead (`vllm serve`, `diffusion/core/prestart.py`);
        the first diffusion stage to start takes it, and it is let go once the stages started if none did."""
        # Stage processes are started from a process that runs several threads: fork is unsafe.
        # Where the user chose no start method, their EngineCores may fork their own workers (plugins.py).
        if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ[ENGINE_CORE_FORKS_WORKERS] = "1"
        self.config = config
        if stage_client_factory is None:
            stage_client_factory = functools.partial(make_stage_client, prestarted_core=prestarted_core)
        self._runtime = StageRuntime(config, stage_client_factory)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        start = time.perf_counter()
        timeout = config.init_timeout or sum(s.stage_init_timeout * s.num_replicas for s in config.stages) + 30.0
        try:
            pools = self._start_stages(timeout)
        finally:
            if prestarted_core is not None:
                prestarted_core.close()
        try:
            self.stage_clients: list[Any] = [pool.clients[0] for pool in pools]
            self.stage_metadata: list[dict[str, Any]] = [self._describe(client) for client in self.stage_clients]
            self.capabilities = self._capabilities()
            """What the served model can do (for the HTTP layer)."""
            self.orchestrator = Orchestrator(pools, config,
                                             stage_modalities=[m["output_modality"] for m in self.stage_metadata])
        except BaseException:
            self._runtime.shutdown()
            raise
        logger.info("[AsyncOmniEngine] %d stage(s) %s ready in %.1f s", len(config.stages), config.stage_types,
                    time.perf_counter() - start)

    def _start_stages(self, timeout: float) -> list:
        """Start every stage on a loop of its own thread (the caller's loop, if any, is blocked meanwhile);
        past `timeout` the start is cancelled and what started is shut down (`StageRuntime.start`)."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["pools"] = asyncio.run(asyncio.wait_for(self._runtime.start(), timeout))
            except TimeoutError:
                outcome["error"] = RuntimeError(f"engine did not become ready within {timeout:.0f} s")
            except BaseException as e:
                outcome["error"] = e

        thread = threading.Thread(target=run, name="OmniStageStart", daemon=True)
        thread.start()
        thread.join(timeout + START_JOIN_GRACE_S)
        if thread.is_alive():
            raise RuntimeError(f"engine did not become ready within {timeout:.0f} s (start-up still running)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["pools"]

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

    # ---- the caller's loop -------------------------------------------------------------------------------
    def bind_loop(self) -> None:
        """Bind the engine to the running loop on first use (stage clients' tasks, the stage monitor); another
        loop later is refused: vLLM's AsyncLLM inside an AR stage is bound to the loop it first served."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None:
            raise RuntimeError(
                "this AsyncOmni is bound to the event loop it was first used in; create one AsyncOmni per event "
                "loop (for example inside the coroutine given to asyncio.run), or use Omni for blocking calls"
            )
        self._loop = loop
        for pool in self._runtime.pools:
            pool.on_loop()
        self.orchestrator.start_monitor()

    # ---- frontend API (on the bound loop) ----------------------------------------------------------------
    @property
    def stage_vllm_configs(self) -> list[Any]:
        return [getattr(c, "vllm_config", None) if c.kind is StageKind.AR else None for c in self.stage_clients]

    @property
    def is_dead(self) -> bool:
        return self.orchestrator.dead_error is not None

    @property
    def dead_error(self) -> str | None:
        return self.orchestrator.dead_error

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

    def add_request(self, request_id: str, prompt: Any, sampling_params_list: list[Any], sink: OutputSink,
                    output_modalities: list[str] | None = None) -> None:
        """Start the request; its outputs, in order, then at most one exception go to `sink`."""
        self.bind_loop()
        self.orchestrator.add_request(request_id, prompt, sampling_params_list, sink, output_modalities)

    async def abort(self, request_ids: list[str], timeout: float | None = None) -> None:
        """Abort and return once every stage freed the requests."""
        self.bind_loop()
        try:
            await asyncio.wait_for(self.orchestrator.abort(list(request_ids)), timeout)
        except TimeoutError:
            raise RuntimeError(f"abort timed out after {timeout} seconds") from None

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort without waiting (a caller that stopped reading: its task is being cancelled)."""
        self.orchestrator.abort_soon(list(request_ids))

    async def collective_rpc_async(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                                   stage_ids: list[int] | None = None,
                                   timeout: float | None = None) -> dict[int, list[Any]]:
        self.bind_loop()
        wait = None if timeout is None else timeout + 5.0
        try:
            return await asyncio.wait_for(self.orchestrator.collective_rpc(method, timeout, tuple(args), kwargs,
                                                                           stage_ids), wait)
        except TimeoutError:
            raise RuntimeError(f"collective_rpc {method} timed out after {wait} seconds") from None

    async def shutdown_async(self) -> None:
        """Stop every request and shut the stages down side by side, on the bound loop: it keeps running meanwhile,
        so the tasks the clients cancel from their stop threads do end."""
        if self._closed:
            return
        self._closed = True
        self.orchestrator.close()
        await self._runtime.shutdown_async()

    def shutdown(self) -> None:
        """Stop every request and shut the stages down one after another, where no loop can be awaited: after the
        bound loop stopped (on a running loop use `shutdown_async`)."""
        if self._closed:
            return
        self._closed = True
        self.orchestrator.close()
        self._runtime.shutdown()
