"""Run functions on gloo ranks (processes of their own) under diffusion parallel configs.

One start of the ranks serves a list of jobs: for each `(parallel kwargs, fn, args)` the first `world_size` ranks
initialize `init_diffusion_distributed` exactly as diffusion workers do, run `fn(*args)` with the VllmConfig
current, and tear the groups down; the other ranks sit the job out. Rank 0's return values come back in job
order (a rank that raises fails the run with its traceback). The ranks start as a diffusion engine's workers do
where it cannot fork (vllm_omni/diffusion/process_start.py): from multiprocessing's forkserver, which imports
torch, vLLM and our runtime once per pytest process (a spawn pays those 5-7 s of a 2-core machine per rank and
run).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_omni.diffusion.ipc import cleanup_shm
from vllm_omni.diffusion.process_start import child_process, start_context

TIMEOUT_S = 1200
Job = tuple[dict, Callable, tuple]


def _run_job(rank: int, init_file: str, job: Job) -> Any:
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
                                        distributed_init_method=f"file://{init_file}")
    try:
        with set_current_vllm_config(config):
            return fn(*args)
    finally:
        destroy_diffusion_distributed()


def _rank_main(rank: int, workdir: str, jobs: list[Job], queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        results = [_run_job(rank, f"{workdir}/{Path(workdir).name}-job{i}", job) for i, job in enumerate(jobs)]
        queue.put((rank, None, results if rank == 0 else None))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))


def run_jobs(jobs: list[Job]) -> list[Any]:
    """Rank 0's result of every job, in order."""
    import tempfile

    from vllm_omni.diffusion.data import DiffusionParallelConfig

    nprocs = max(DiffusionParallelConfig(**parallel).world_size for parallel, _, _ in jobs)
    ctx = start_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="omni-ranks-") as workdir:  # file:// rendezvous: no port races
        procs = [child_process(ctx, _rank_main, (r, workdir, jobs, queue), f"rank-{r}", daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        results = []
        try:
            while len(results) < nprocs and not any(err for _, err, _ in results):  # one failure ends the run
                results.append(queue.get(timeout=TIMEOUT_S))
        finally:
            for p in procs:
                p.join(timeout=0 if any(err for _, err, _ in results) else 30)
                if p.is_alive():
                    p.kill()
                    p.join(10)
            # vLLM's CPU group shared memory (named after the rendezvous file: `job<i>-tp:...-cpushm_<rank>`) is
            # unlinked by its owner's destructor at interpreter exit, which a rank ending in `os._exit` (a fork's
            # end) skips.
            cleanup_shm(Path(workdir).name)
    errors = [f"rank {r}:\n{err}" for r, err, _ in results if err]
    assert not errors, "\n".join(errors)
    return next(res for r, _, res in results if r == 0)
