"""Run functions on in-process gloo ranks (torch.multiprocessing spawn) under diffusion parallel configs.

One spawn serves a list of jobs: for each `(parallel kwargs, fn, args)` the first `world_size` ranks
initialize `init_diffusion_distributed` exactly as diffusion workers do, run `fn(*args)` with the VllmConfig
current, and tear the groups down; the other ranks sit the job out. Rank 0's return values come back in job
order (a rank that raises fails the run with its traceback). Spawning costs seconds of imports per process, so
tests share one spawn.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 600
Job = tuple[dict, Callable, tuple]


def _run_job(rank: int, port: int, job: Job) -> Any:
    from vllm.config import set_current_vllm_config

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    parallel, fn, args = job
    parallel_config = DiffusionParallelConfig(**parallel)
    if rank >= parallel_config.world_size:
        return None
    config = init_diffusion_distributed(rank=rank, world_size=parallel_config.world_size,
                                        device=torch.device("cpu"), parallel_config=parallel_config,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
    try:
        with set_current_vllm_config(config):
            return fn(*args)
    finally:
        destroy_diffusion_distributed()


def _rank_main(rank: int, ports: list[int], jobs: list[Job], queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        results = [_run_job(rank, port, job) for port, job in zip(ports, jobs, strict=True)]
        queue.put((rank, None, results if rank == 0 else None))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))


def run_jobs(jobs: list[Job]) -> list[Any]:
    """Rank 0's result of every job, in order."""
    from vllm.utils.network_utils import get_open_ports_list

    from vllm_omni.diffusion.data import DiffusionParallelConfig

    nprocs = max(DiffusionParallelConfig(**parallel).world_size for parallel, _, _ in jobs)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = get_open_ports_list(len(jobs))
    procs = [ctx.Process(target=_rank_main, args=(r, ports, jobs, queue), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{err}" for r, err, _ in results if err]
    assert not errors, "\n".join(errors)
    return next(res for r, _, res in results if r == 0)
