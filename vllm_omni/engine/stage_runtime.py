"""Starts every stage's replicas in order, with a readiness timeout, and shuts them all down side by side (or, after
a failed start, one after another)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import StageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def make_stage_client(config: StageConfig, replica_id: int) -> StageClientBase:
    if config.kind is StageKind.AR:
        from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient

        return StageEngineCoreClient(config, replica_id)
    if config.kind is StageKind.DIFFUSION:
        from vllm_omni.engine.stage_diffusion_client import StageDiffusionClient

        return StageDiffusionClient(config, replica_id)
    if config.kind is StageKind.GENERATION:
        from vllm_omni.engine.stage_generation_client import StageGenerationClient

        return StageGenerationClient(config, replica_id)
    raise ValueError(f"stage {config.stage_id}: unknown stage kind {config.kind!r}")


@contextlib.contextmanager
def stage_environ(env: dict[str, str]):
    """Stage processes inherit the environment at spawn time; stages start one at a time."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


StageClientFactory = Callable[[StageConfig, int], StageClientBase]

SHUTDOWN_TIMEOUT_S = 30.0
"""How long `StageRuntime.shutdown` waits for all stages together. Each client bounds its own stop (vLLM kills an
EngineCore that outlives its 10 s grace); a stage still stopping after this is logged and left to that."""


class StageRuntime:
    def __init__(self, config: VllmOmniConfig, client_factory: StageClientFactory = make_stage_client) -> None:
        self.config = config
        self.client_factory = client_factory
        self.pools: list[StagePool] = []

    async def start(self) -> list[StagePool]:
        try:
            for stage in self.config.stages:
                clients: list[StageClientBase | None] = []
                self.pools.append(StagePool(stage.stage_id, clients, stage.kind))
                for replica in range(stage.num_replicas):
                    client = self.client_factory(stage, replica)
                    start = time.perf_counter()
                    devices = stage.replica_devices(replica)
                    with stage_environ({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}):
                        await client.start()
                    clients.append(client)
                    logger.info("[StageRuntime] %s ready in %.1f s", client.name, time.perf_counter() - start)
        except BaseException as e:
            failed = self.config.stages[len(self.pools) - 1]
            self.shutdown()
            raise RuntimeError(f"stage {failed.stage_id} ({failed.stage_type}, model {failed.model}) failed to "
                               f"start: {type(e).__name__}: {e}") from e
        return self.pools

    def shutdown(self) -> None:
        """Every replica of every stage stops at once, each in a thread of its own, where no event loop drives the
        clients any more (a start that failed part-way, or after the loop stopped); bounded by the same timeout."""
        threads = [threading.Thread(target=_shutdown_client, args=(client,), name=f"shutdown-{client.name}",
                                    daemon=True) for client in self._take_clients()]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if late := [thread.name for thread in threads if thread.is_alive()]:
            logger.error("[StageRuntime] %s still shutting down after %.0f s", late, SHUTDOWN_TIMEOUT_S)

    async def shutdown_async(self) -> None:
        """Every replica of every stage stops at once, each in a thread of its own: no stage's process teardown
        (seconds of vLLM's EngineCore and worker exit on a CPU) waits for another's. The Orchestrator has stopped
        sending by then, so no order between stages is needed. The event loop keeps running meanwhile, so the
        tasks the clients cancel from their threads do end."""
        clients = self._take_clients()
        if len(clients) <= 1:
            for client in clients:
                _shutdown_client(client)
            return
        loop = asyncio.get_running_loop()
        stopped = [loop.create_future() for _ in clients]
        start = time.monotonic()
        for client, done in zip(clients, stopped, strict=True):
            threading.Thread(target=_shutdown_in_thread, args=(client, loop, done), name=f"shutdown-{client.name}",
                             daemon=True).start()
        _, late = await asyncio.wait(stopped, timeout=SHUTDOWN_TIMEOUT_S)
        if late:
            names = [client.name for client, done in zip(clients, stopped, strict=True) if done in late]
            logger.error("[StageRuntime] %s still shutting down after %.0f s", names, SHUTDOWN_TIMEOUT_S)
        else:
            logger.info("[StageRuntime] %d stage clients shut down side by side in %.1f s", len(clients),
                        time.monotonic() - start)

    def _take_clients(self) -> list[StageClientBase]:
        clients = [client for pool in reversed(self.pools) for client in pool.clients if client is not None]
        self.pools = []
        return clients


def _shutdown_in_thread(client: StageClientBase, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
    _shutdown_client(client)
    with contextlib.suppress(RuntimeError):  # the loop is closed: the runtime stopped waiting (logged there)
        loop.call_soon_threadsafe(done.set_result, None)


def _shutdown_client(client: StageClientBase) -> None:
    try:
        client.shutdown()
    except Exception:
        logger.exception("[StageRuntime] %s failed to shut down cleanly", client.name)
