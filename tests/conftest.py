"""Shared test setup: markers, the tiny-checkpoint cache, CPU-friendly vLLM defaults, and the process-group
fixture `dist_world` of every test that builds a diffusion model (tests/diffusion and tests/models alike), and
`shared_server`, the live `vllm serve` processes that several modules share."""

from __future__ import annotations

import os

import pytest

# vLLM CPU: keep the KV cache small so several engines fit beside each other on a 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def dist_world():
    """A gloo world of size 1 with vLLM's model-parallel groups and a current VllmConfig, for the module.

    vLLM's parallel linear layers need these groups even at tensor-parallel size 1. A module that finds groups
    already set up (by an earlier module in the same process) reuses them and leaves them to their owner.
    """
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            yield
        return
    config = init_diffusion_distributed(
        rank=0, world_size=1, parallel_config=DiffusionParallelConfig(), device=torch.device("cpu")
    )
    try:
        with set_current_vllm_config(config):
            yield
    finally:
        destroy_diffusion_distributed()


@pytest.fixture(scope="session")
def shared_server():
    """`shared_server(model, *args)`: one live `vllm serve model --omni *args` per distinct (model, args), shared
    by every module that asks for it (tests/entrypoints/openai/live_server.py names the shared ones).

    A start costs 10-40 s of CI, so modules that only send requests share a server; modules that kill, restart or
    sleep theirs keep their own. Each is started on first use (again if an earlier user left it dead) and
    SIGTERMed at the end of the session, which must leave no process behind, as each module used to check.
    """
    from tests.entrypoints.openai.live_server import LiveServer

    servers: dict[tuple[str, ...], LiveServer] = {}

    def get(model: str, *args: str) -> LiveServer:
        key = (model, *args)
        if key in servers and servers[key].proc.poll() is not None:
            servers.pop(key).close()
        if key not in servers:
            servers[key] = LiveServer(model, *args)
        return servers[key]

    yield get
    for srv in servers.values():  # all at once: each takes seconds to stop its engine
        srv.terminate()
    unclean = [str(srv.log) for srv in servers.values() if not srv.close()]
    assert not unclean, f"shared servers did not shut down cleanly on SIGTERM; logs: {unclean}"


@pytest.fixture(scope="session")
def stop_later():
    """`stop_later(server)`: SIGTERM a module's own live server at its end and check at the end of the session
    that it exited cleanly, leaving no process behind.

    A server takes seconds to stop (an AR one ~10 s: vLLM's CPU worker outlives its 5 s shutdown grace); the next
    modules run meanwhile instead of waiting for it.
    """
    stopping = []

    def stop(server) -> None:
        server.terminate()
        stopping.append(server)

    yield stop
    unclean = [str(srv.log) for srv in stopping if not srv.close()]
    assert not unclean, f"servers did not shut down cleanly on SIGTERM; logs: {unclean}"
