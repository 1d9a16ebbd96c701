"""Step mode on more than one rank: rank 0 takes every decision of a round, the other ranks follow it.

All ranks of a stage run the same step batch (the transformer forward is split over them, with collectives
inside), so they must admit, pause, retire and abort exactly the same requests at the same round. A decision taken
per rank could differ: each rank reads the engine's messages from its own socket at its own time, aborts arrive
on each rank's own channel, and the scheduling policy reads the clock. So rank 0 decides and broadcasts over the
world group's CPU group (a few small objects per round, beside the step's own collectives):

    round start  the batches rank 0 has (a rank that has not read one of them yet reads its input until it has)
                 and the requests that count as aborted during this round (rank 0's abort set, snapshotted)
    admission    the jobs the policy chose to step, in order (resident, resumed or newly admitted)

A rank that is ahead (it read a batch rank 0 has not) just waits for rank 0 to list it. Everything else a round
does (which states are done, forward grouping, a request that raises) depends only on these inputs and is the
same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

JobKey = tuple[int, int]
"""(batch_id, index of the request in its batch)."""


class RoundStart(msgspec.Struct, frozen=True):
    """Rank 0's view at the start of a round."""

    batch_ids: list[int]
    aborted: list[tuple[int, str]]
    """(batch_id, request_id) pairs aborted for the whole round."""


class RankSync:
    """The broadcasts of one step-mode worker (`fetch(batch_ids)` reads the input until those batches are in)."""

    def __init__(self, fetch: Callable[[set[int]], None]) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self.group = get_world_group()
        self.fetch = fetch

    @property
    def is_leader(self) -> bool:
        return self.group.rank_in_group == 0

    def start_round(self, batch_ids: list[int], aborted: set[tuple[int, str]]) -> set[tuple[int, str]]:
        """Rank 0's aborted pairs for this round, once this rank has every batch rank 0 has."""
        plan = RoundStart(sorted(batch_ids), sorted(aborted)) if self.is_leader else None
        plan = self.group.broadcast_object(plan, src=0)
        missing = set(plan.batch_ids) - set(batch_ids)
        if missing:
            self.fetch(missing)
        return {(batch_id, request_id) for batch_id, request_id in plan.aborted}

    def agree(self, chosen: list[JobKey]) -> list[JobKey]:
        """Rank 0's choice of the jobs that step this round (the other ranks pass anything)."""
        keys = self.group.broadcast_object(chosen if self.is_leader else None, src=0)
        return [(batch_id, index) for batch_id, index in keys]
