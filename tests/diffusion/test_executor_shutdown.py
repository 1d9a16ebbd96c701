"""Shutdown escalation of the diffusion executor against one global deadline, with stand-in processes.

What it pins: workers that exit when asked are only joined; one that ignores the request is terminated;
one that also ignores SIGTERM is killed; the whole sequence stays within the deadline (plus the final
1 s join after a kill).
"""

from __future__ import annotations

import time

from vllm_omni.diffusion.executor.multiproc_executor import _stop_processes


class StandIn:
    """Exits after `exits_after` s, on terminate() if `obeys_term`, always on kill()."""

    def __init__(self, name: str, exits_after: float | None, obeys_term: bool = True) -> None:
        self.name = name
        self.start = time.monotonic()
        self.exits_after = exits_after
        self.obeys_term = obeys_term
        self.dead = False
        self.calls: list[str] = []

    def is_alive(self) -> bool:
        if self.exits_after is not None and time.monotonic() - self.start >= self.exits_after:
            self.dead = True
        return not self.dead

    def join(self, timeout: float | None = None) -> None:
        end = time.monotonic() + (timeout or 0.0)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.01)

    def terminate(self) -> None:
        self.calls.append("terminate")
        self.dead = self.dead or self.obeys_term

    def kill(self) -> None:
        self.calls.append("kill")
        self.dead = True


def test_escalation_within_one_deadline():
    polite = StandIn("polite", exits_after=0.1)
    stubborn = StandIn("stubborn", exits_after=None)
    deaf = StandIn("deaf", exits_after=None, obeys_term=False)
    start = time.monotonic()
    _stop_processes([polite, stubborn, deaf], deadline=start + 2.0)
    elapsed = time.monotonic() - start
    assert not any(p.is_alive() for p in (polite, stubborn, deaf))
    assert polite.calls == [] and stubborn.calls == ["terminate"] and deaf.calls == ["terminate", "kill"]
    assert elapsed < 2.0 + 1.0 + 0.5


def test_expired_deadline_still_stops_everything_quickly():
    deaf = StandIn("deaf", exits_after=None, obeys_term=False)
    start = time.monotonic()
    _stop_processes([deaf], deadline=start - 5.0)
    assert not deaf.is_alive() and deaf.calls == ["terminate", "kill"]
    assert time.monotonic() - start < 1.0
