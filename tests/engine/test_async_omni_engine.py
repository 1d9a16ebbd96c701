"""AsyncOmniEngine lifecycle with in-process stages: readiness, start-up failure naming the stage, the engine
on the caller's loop (no thread of its own left running; a second loop refused), and shutdown last stage first.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.engine.fakes import ModelLessStage
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.errors import EngineDeadError
from vllm_omni.outputs import OmniRequestOutput


class Echo(ModelLessStage):
    started: list[int] = []
    stopped: list[int] = []

    async def start(self) -> None:
        if self.config.engine_args.get("fail"):
            raise RuntimeError("weights missing")
        Echo.started.append(self.stage_id)

    async def generate(self, request_id, prompt, sampling_params):
        yield OmniRequestOutput(request_id=request_id, stage_id=self.stage_id, text=f"{prompt}>{self.stage_id}")

    def shutdown(self) -> None:
        Echo.stopped.append(self.stage_id)


def config(fail_stage: int | None = None) -> VllmOmniConfig:
    stages = [VllmOmniARStageConfig(stage_id=i, model="echo", final_output=i == 2, inputs=[i - 1] if i else [],
                                    input_processor="text_to_prompt" if i else None,
                                    engine_args={"fail": True} if i == fail_stage else {}) for i in range(3)]
    return VllmOmniConfig(model="echo", model_path="echo", pipeline_name="echo", stages=stages)


class SideBySide(Echo):
    """Each stage's shutdown returns only once all three are inside theirs: one after another never gets there."""

    barrier = threading.Barrier(3, timeout=10)

    def shutdown(self) -> None:
        SideBySide.barrier.wait()
        super().shutdown()


def test_three_stages_run_and_shut_down_side_by_side():
    Echo.started, Echo.stopped = [], []
    SideBySide.barrier.reset()
    engine = AsyncOmniEngine(config(), stage_client_factory=SideBySide)
    try:
        assert [m["stage_type"] for m in engine.stage_metadata] == ["llm"] * 3 and not engine.is_dead
        # Only stage 0 takes the user's prompt; only stage 2 is final.
        assert engine.capabilities == ModelCapabilities(stage_kinds=(StageKind.AR,) * 3,
                                                        input_modalities=frozenset({"text"}),
                                                        output_modalities=frozenset({"text"}))
        threads = {t.name for t in threading.enumerate()}
        assert "OmniStageStart" not in threads  # the start-up thread ended with the start-up

        async def request():
            outputs = asyncio.Queue()
            engine.add_request("r", "x", [None] * 3, outputs.put_nowait)
            return await asyncio.wait_for(outputs.get(), 5)

        out = asyncio.run(request())
        assert out.finished and out.text == "x>0>1>2"
        with pytest.raises(RuntimeError, match="bound to the event loop"):
            asyncio.run(request())
    finally:
        engine.shutdown()
    assert Echo.started == [0, 1, 2] and sorted(Echo.stopped) == [0, 1, 2]
    assert not any(t.name == "OmniOrchestrator" and t.is_alive() for t in threading.enumerate())


class StartSideBySide(Echo):
    """Each stage's start returns only once all three are inside theirs: one after another never gets there."""

    inside: list[int] = []

    async def start(self) -> None:
        StartSideBySide.inside.append(self.stage_id)
        while len(StartSideBySide.inside) < 3:
            await asyncio.sleep(0.01)
        await super().start()


def test_stages_start_side_by_side():
    Echo.started, Echo.stopped, StartSideBySide.inside = [], [], []
    engine = AsyncOmniEngine(config(), stage_client_factory=StartSideBySide)
    engine.shutdown()
    assert sorted(Echo.started) == [0, 1, 2] and sorted(Echo.stopped) == [0, 1, 2]


class SlowEcho(Echo):
    """Stage 2 takes its time: the failure of stage 1 cancels it (it never starts), stage 0 is stopped."""

    async def start(self) -> None:
        if self.stage_id == 2:
            await asyncio.sleep(30)
        await super().start()


def test_start_failure_names_stage_cancels_the_others_and_stops_started_ones():
    Echo.started, Echo.stopped = [], []
    with pytest.raises(RuntimeError, match=r"stage 1 \(llm, model echo\) failed to start: RuntimeError: weights"):
        AsyncOmniEngine(config(fail_stage=1), stage_client_factory=SlowEcho)
    assert Echo.started == [0] and Echo.stopped == [0]


def test_stage_monitor_marks_the_engine_dead_for_every_waiter():
    """A stage that dies under a running request: the request gets EngineDeadError, so do later ones."""

    class Stuck(Echo):
        dead = False

        async def generate(self, request_id, prompt, sampling_params):
            await asyncio.sleep(30)
            yield  # an async generator

        @property
        def is_dead(self) -> bool:
            return Stuck.dead

    engine = AsyncOmniEngine(config(), stage_client_factory=Stuck)
    try:
        async def scenario():
            outputs = asyncio.Queue()
            engine.add_request("r", "x", [None] * 3, outputs.put_nowait)
            await asyncio.sleep(0.05)
            Stuck.dead = True
            err = await asyncio.wait_for(outputs.get(), 5)
            engine.add_request("late", "x", [None] * 3, outputs.put_nowait)
            return err, await asyncio.wait_for(outputs.get(), 5)

        err, late = asyncio.run(scenario())
        assert isinstance(err, EngineDeadError) and isinstance(late, EngineDeadError)
        assert engine.is_dead and "stage 0 (llm) died" in engine.dead_error
    finally:
        engine.shutdown()


def test_cancel_task_from_another_thread_wakes_the_loop():
    """Why: stages stop side by side from threads of their own; a task cancelled there with `Task.cancel()` (not
    thread-safe) would not wake the loop, and under asyncio debug raises."""
    from vllm_omni.engine.stage_client import cancel_task

    async def main():
        task = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)
        canceller = threading.Thread(target=cancel_task, args=(task,))
        canceller.start()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)
        canceller.join(timeout=5)

    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
