"""What each rank runs in the multi-rank step-mode tests (importable by name for the spawned ranks).

`run_step_script` drives a real `StepWorker` per rank with the plans of a real `DiffusionScheduler`, the way the
engine's step thread does: requests reach the scheduler and aborts land at the engine's rounds (`arrivals[0]`,
`aborts[0]`: what the other ranks' entries say about their own sockets no longer matters, since a rank reads
nothing but the plan). Every rank builds the same plans from the same inputs, as every rank receives the one plan
the engine sends. Each rank counts the object broadcasts it made while executing the plans: there must be none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

Arrivals = dict[int, dict[str, int]]
"""rank -> request id -> the round before which it reaches that rank (one request each); rank 0's is the
engine's."""


def run_step_script(model_dir: str, parallel: dict, requests: dict[str, tuple[dict, dict]], arrivals: Arrivals,
                    aborts: Arrivals, max_rounds: int = 50, max_num_seqs: int = 2) -> dict[str, Any]:
    """Per rank (rank 0 gathers them): each request's output (array) or error type, how many rounds it ran, and
    how many object broadcasts the rank made in them."""
    from vllm.distributed.parallel_state import GroupCoordinator, get_world_group

    from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.step_runner import StepWorker

    group = get_world_group()
    od_config = OmniDiffusionConfig(model=model_dir, parallel_config=DiffusionParallelConfig(**parallel),
                                    step_execution=True, max_num_seqs=max_num_seqs)
    runner = DiffusionModelRunner(od_config, torch.device("cpu"), group.rank_in_group)
    runner.load_model()
    scheduler = DiffusionScheduler(od_config)
    worker = StepWorker(runner, group.rank_in_group, multi_rank=group.world_size > 1)
    inbox = sorted(requests, key=lambda rid: arrivals[0][rid])
    outputs: dict[str, Any] = {}
    broadcasts = [0]
    originals = GroupCoordinator.broadcast_object, torch.distributed.broadcast_object_list

    def counted(fn):
        def call(*args, **kwargs):
            broadcasts[0] += 1
            return fn(*args, **kwargs)
        return call

    GroupCoordinator.broadcast_object = counted(originals[0])
    torch.distributed.broadcast_object_list = counted(originals[1])
    rounds = 0
    try:
        for engine_round in range(max_rounds):
            while inbox and arrivals[0][inbox[0]] <= engine_round:
                rid = inbox.pop(0)
                prompt, params = requests[rid]
                scheduler.add(OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), rid))
            for rid, at in aborts.get(0, {}).items():
                if at == engine_round:
                    for job in scheduler.abort([rid]):
                        outputs[job.request_id] = "aborted"
            if not scheduler.has_work:
                if not inbox:
                    break
                continue
            plan = scheduler.schedule()
            for job, out in scheduler.update(plan, worker.execute(plan)):
                outputs[job.request_id] = (out.error_type if out.error is not None
                                           else np.asarray(out.output, dtype=np.float64))
            rounds += 1
    finally:
        GroupCoordinator.broadcast_object, torch.distributed.broadcast_object_list = originals
    mine = {"rounds": rounds, "outputs": outputs, "broadcasts": broadcasts[0]}
    every: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(every, mine, group=group.cpu_group)
    return every
