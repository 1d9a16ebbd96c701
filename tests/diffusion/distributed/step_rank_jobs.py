"""What each rank runs in the multi-rank step-mode tests (importable by name for the spawned ranks).

`run_step_script` drives a real `StepExecutor` with the `RankSync` of the worker loop, feeding it messages the
way a worker's input and abort sockets would, but at rank-specific rounds: each rank sees a batch arrive or an
abort land at its own round, as real ranks do when their sockets are read at different times.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

Arrivals = dict[int, dict[str, int]]
"""rank -> request id -> the local round before which it reaches that rank (one batch per request)."""


def run_step_script(model_dir: str, parallel: dict, requests: dict[str, tuple[dict, dict]], arrivals: Arrivals,
                    aborts: Arrivals, max_rounds: int = 50, max_num_seqs: int = 2) -> dict[str, Any]:
    """Per rank (rank 0 gathers them): each request's output (array) or error type, and how many rounds it
    ran."""
    from vllm.distributed.parallel_state import get_world_group

    from vllm_omni.diffusion.ipc import AbortRequests
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.step_runner import StepExecutor
    from vllm_omni.diffusion.worker.step_sync import RankSync
    from vllm_omni.diffusion.worker.worker_proc import AbortedRequests

    rank = get_world_group().rank_in_group
    od_config = OmniDiffusionConfig(model=model_dir, parallel_config=DiffusionParallelConfig(**parallel),
                                    step_execution=True, max_num_seqs=max_num_seqs)
    runner = DiffusionModelRunner(od_config, torch.device("cpu"), rank)
    runner.load_model()
    ids = list(requests)
    inbox = sorted(ids, key=lambda rid: arrivals[rank][rid])  # this rank's input socket, in arrival order
    outputs: dict[int, Any] = {}
    aborted = AbortedRequests()

    def deliver(up_to: int) -> None:
        while inbox and (arrivals[rank][inbox[0]] <= up_to):
            rid = inbox.pop(0)
            prompt, params = requests[rid]
            executor.add(ids.index(rid), [OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), rid)],
                         None)

    def fetch(batch_ids: set[int]) -> None:  # the worker reads its input in order until rank 0's batches are in
        while batch_ids - executor.batch_ids:
            deliver(arrivals[rank][inbox[0]])

    executor = StepExecutor(runner, lambda batch_id, outs: outputs.__setitem__(batch_id, outs[0]), aborted,
                            RankSync(fetch))
    rounds = 0
    for local_round in range(max_rounds):
        deliver(local_round)
        for rid, at in aborts.get(rank, {}).items():
            if at == local_round:
                aborted.add(AbortRequests(ids.index(rid), [rid]))
        if executor.has_work:
            executor.run_round()
            rounds += 1
        elif not inbox:
            break
    mine = {"rounds": rounds, "outputs": {
        ids[b]: out.error_type if out.error is not None else np.asarray(out.output, dtype=np.float64)
        for b, out in outputs.items()}}
    every: list[Any] = [None] * get_world_group().world_size
    torch.distributed.all_gather_object(every, mine, group=get_world_group().cpu_group)
    return every
