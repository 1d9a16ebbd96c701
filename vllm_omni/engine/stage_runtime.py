"""Starts every replica of every stage side by side, with a readiness timeout, and shuts them all down side by
side (or, after a failed start, where no loop runs any more, from threads of their own)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import StageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def make_stage_client(config: StageConfig, replica_id: int, prestarted_core: PrestartedCore | None = None
                      ) -> StageClientBase:
    """The client of one stage replica; a DIFFUSION stage may take `prestarted_core` (`diffusion/core/prestart.py`)."""
    if config.kind is StageKind.AR:
        from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient

        return StageEngineCoreClient(config, replica_id)
    if config.kind is StageKind.DIFFUSION:
        from vllm_omni.engine.stage_diffusion_client import StageDiffusionClient

        return StageDiffusionClient(config, replica_id, prestarted_core)
    if config.kind is StageKind.GENERATION:
        from vllm_omni.engine.stage_generation_client import StageGenerationClient

        return StageGenerationClient(config, replica_id)
    raise ValueError(f"stage {config.stage_id}: unknown stage kind {config.kind!r}")


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
        """Every replica of every stage starts at once: no stage needs another one running to start (the edges
        carry requests only), and each replica's processes get its own environment (`spawn_environ`). The first
        failure cancels the starts still running; whatever started is shut down."""
        self.pools = [StagePool(stage.stage_id, [None] * stage.num_replicas, stage.kind)
                      for stage in self.config.stages]
        tasks = {asyncio.ensure_future(self._start_replica(pool, stage, replica)): stage
                 for pool, stage in zip(self.pools, self.config.stages, strict=True)
                 for replica in range(stage.num_replicas)}
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled (the readiness timeout): stop what started, then end as asked
            await _cancel_all(tasks)
            self.shutdown()
            raise
        failed = next((task for task in tasks if task in done and task.exception() is not None), None)
        if failed is None:
            return self.pools
        await _cancel_all(pending)
        self.shutdown()
        stage, e = tasks[failed], failed.exception()
        raise RuntimeError(f"stage {stage.stage_id} ({stage.stage_type}, model {stage.model}) failed to start: "
                           f"{type(e).__name__}: {e}") from e

    async def _start_replica(self, pool: StagePool, stage: StageConfig, replica: int) -> None:
        client = self.client_factory(stage, replica)
        start = time.perf_counter()
        await client.start()  # a start that fails or is cancelled cleans up after itself
        pool.clients[replica] = client
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in client.startup_phases.items())
        logger.info("[StageRuntime] %s ready in %.2f s%s", client.name, time.perf_counter() - start,
                    f" ({phases})" if phases else "")

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


async def _cancel_all(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _shutdown_in_thread(client: StageClientBase, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
    _shutdown_client(client)
    with contextlib.suppress(RuntimeError):  # the loop is closed: the runtime stopped waiting (logged there)
        loop.call_soon_threadsafe(done.set_result, None)


def _shutdown_client(client: StageClientBase) -> None:
    try:
        client.shutdown()
    except Exception:
        logger.exception("[StageRuntime] %s failed to shut down cleanly", client.name)
