"""What the Orchestrator needs from a stage, whatever runs it (vLLM EngineCore, diffusion runtime, ...)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import Modality
from vllm_omni.config.stage_config import StageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.outputs import OmniRequestOutput


def cancel_task(task: asyncio.Task) -> None:
    """`task.cancel()` from any thread: `StageRuntime.shutdown` stops several stages side by side, from threads
    other than the event loop's (asyncio's own calls are not thread-safe)."""
    loop = task.get_loop()
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        task.cancel()
    else:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the task will never run again
            loop.call_soon_threadsafe(task.cancel)


class StageClientBase:
    """One replica of one stage, driven from the event loop of whoever calls the engine (as vLLM's AsyncLLM).

    `start` may run on another loop than the one that drives the client afterwards (the engine starts its
    stages on a start-up loop of its own): loop-bound state (tasks, events) belongs in `on_loop`, which the
    engine calls once on the driving loop before any other call.

    `generate` yields the stage's outputs for one request (the last one has `finished=True`); a failure of
    that request alone raises; the death of the stage raises `EngineDeadError` and sets `is_dead`.
    """

    kind: ClassVar[StageKind]

    @property
    def stage_type(self) -> str:
        """The kind's user-visible name ("llm" for AR)."""
        return self.kind.stage_type

    def __init__(self, config: StageConfig, replica_id: int = 0) -> None:
        self.config = config
        self.stage_id = config.stage_id
        self.replica_id = replica_id
        self.final_output = config.final_output
        self.startup_phases: dict[str, float] = {}
        """Seconds of each phase of the last `start` (e.g. config, worker process, load, warm-up), for the
        start-up log line of the stage."""

    @property
    def name(self) -> str:
        return f"{self.config.name}[{self.replica_id}]"

    def stage_durations(self, elapsed: float, phases: dict[str, float] | None = None) -> dict[str, float]:
        """This stage's time (and its phases') for `OmniRequestOutput.stage_durations`, under two keys each: by
        type (`llm`, `diffusion.denoise`: what one-stage pipelines have always reported; with two stages of one
        type the later one wins) and by stage (`stage-<id>-<type>`, `stage-<id>-<type>.<phase>`: kept per stage,
        what the server's `vllm_omni:stage_duration_seconds` reads)."""
        out: dict[str, float] = {}
        for prefix in (self.config.stage_type, self.config.name):
            out[prefix] = elapsed
            out.update({f"{prefix}.{phase}": seconds for phase, seconds in (phases or {}).items()})
        return out

    async def start(self) -> None:
        """Start the stage's engine; return when it can take requests."""
        raise NotImplementedError

    def on_loop(self) -> None:
        """Called on the loop that drives this client from now on: start its loop-bound tasks there."""

    def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        raise NotImplementedError

    async def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args: tuple = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError

    def default_sampling_params(self) -> Any:
        raise NotImplementedError

    @property
    def output_modality(self) -> str:
        raise NotImplementedError

    @property
    def input_modalities(self) -> frozenset[Modality]:
        """What this stage takes when the user's prompt feeds it (its family spec's declaration)."""
        return frozenset({"text"})

    @property
    def shape_rule(self) -> ShapeRule | None:
        """The output sizes a diffusion stage makes (its family's `ShapeRule`); None: no constraint known."""
        return None

    @property
    def is_dead(self) -> bool:
        raise NotImplementedError

    @property
    def is_restarting(self) -> bool:
        """The stage lost a worker and is starting a new one: degraded, not dead."""
        return False

    def shutdown(self) -> None:
        raise NotImplementedError
