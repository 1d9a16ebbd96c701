"""Starts every stage's replicas in order, with a readiness timeout, and shuts them down in reverse order."""

from __future__ import annotations

import contextlib
import os
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
        from vllm_omni.diffusion.inline_stage_diffusion_client import InlineStageDiffusionClient

        return InlineStageDiffusionClient(config, replica_id)
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
        for pool in reversed(self.pools):
            for client in pool.clients:
                if client is None:
                    continue
                try:
                    client.shutdown()
                except Exception:
                    logger.exception("[StageRuntime] %s failed to shut down cleanly", client.name)
        self.pools = []
