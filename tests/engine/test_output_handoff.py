"""OutputHandOff: what the orchestrator puts in one loop iteration reaches the subscriber's loop as one batch
(one cross-thread wake-up, not one per output; batches join while that loop is busy), in order, nothing merged
or lost; without a subscriber a blocking reader gets the items one by one; a closed subscriber loop does not
break the orchestrator. And AsyncOmni over the real engine thread with a model-less streaming stage: every output
of every stream, in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from functools import partial

import pytest

from tests.engine.fakes import ModelLessStage
from vllm_omni import AsyncOmni
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.output_handoff import OutputHandOff
from vllm_omni.entrypoints import omni_base
from vllm_omni.outputs import OmniRequestOutput


def run_producer(handoff: OutputHandOff, iterations: list[list[str]]) -> None:
    """On a loop of its own thread (as the orchestrator): put each inner list during one loop iteration."""

    async def produce() -> None:
        for items in iterations:
            for item in items:
                handoff.put_nowait(item)
            await asyncio.sleep(0)  # end of this loop iteration: the batch goes out

    thread = threading.Thread(target=asyncio.run, args=(produce(),))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_one_batch_per_producer_iteration_in_order():
    iterations = [[f"r{r}-t{t}" for r in range(8)] for t in range(16)]  # 8 streams, 16 engine steps

    async def consume() -> list[list[str]]:
        handoff, batches, got_all = OutputHandOff(), [], asyncio.Event()

        def deliver(batch: list[str]) -> None:
            batches.append(batch)
            if sum(map(len, batches)) == 8 * 16:
                got_all.set()

        handoff.subscribe(asyncio.get_running_loop(), deliver)
        await asyncio.get_running_loop().run_in_executor(None, run_producer, handoff, iterations)
        await asyncio.wait_for(got_all.wait(), timeout=10)
        return batches

    batches = asyncio.run(consume())
    assert [item for batch in batches for item in batch] == [item for items in iterations for item in items]
    assert len(batches) <= len(iterations)  # fewer when the consumer's loop had not taken the last one yet


def test_batches_join_while_the_subscriber_loop_is_busy():
    async def busy_consumer() -> list[list[str]]:
        handoff, batches = OutputHandOff(), []
        handoff.subscribe(asyncio.get_running_loop(), batches.append)
        run_producer(handoff, [["a"], ["b", "c"], ["d"]])  # blocks this loop: nothing is taken meanwhile
        await asyncio.sleep(0.05)
        return batches

    assert asyncio.run(busy_consumer()) == [["a", "b", "c", "d"]]


def test_blocking_reader_without_subscriber_then_early_items_go_to_the_subscriber_first():
    handoff = OutputHandOff()
    run_producer(handoff, [["a", "b"], ["c"]])
    assert [handoff.get(timeout=1) for _ in range(3)] == ["a", "b", "c"]
    with pytest.raises(queue.Empty):
        handoff.get(timeout=0.01)

    async def subscribe_late() -> list[list[str]]:
        batches: list[list[str]] = []
        run_producer(handoff, [["d"]])
        handoff.subscribe(asyncio.get_running_loop(), batches.append)
        await asyncio.get_running_loop().run_in_executor(None, run_producer, handoff, [["e", "f"]])
        await asyncio.sleep(0.05)
        return batches

    assert asyncio.run(subscribe_late()) == [["d"], ["e", "f"]]


def test_closed_subscriber_loop_drops_quietly():
    handoff = OutputHandOff()
    loop = asyncio.new_event_loop()
    handoff.subscribe(loop, lambda batch: None)
    loop.close()
    run_producer(handoff, [["x"]])  # flush on the producer's loop must not raise
    with pytest.raises(queue.Empty):
        handoff.get(timeout=0.01)


class Streamer(ModelLessStage):
    """An AR stage with no model: `TOKENS` outputs per request, one per loop iteration (as vLLM's AsyncLLM
    hands out one engine step's outputs for all running requests in one iteration)."""

    async def generate(self, request_id, prompt, sampling_params):
        for i in range(TOKENS):
            await asyncio.sleep(0)
            yield OmniRequestOutput(request_id=request_id, stage_id=0, finished=i == TOKENS - 1, token_ids=[i])


TOKENS, STREAMS = 16, 8


def test_async_omni_streams_every_output_in_order_with_one_wakeup_per_step(monkeypatch):
    """Through the real engine thread and orchestrator: every stream gets each of its outputs once, in order, the
    last one finished; the frontend's loop is woken about once per step for all streams, not once per output."""
    config = VllmOmniConfig(model="s", model_path="s", pipeline_name="s",
                            stages=[VllmOmniARStageConfig(stage_id=0, model="s", final_output=True)])
    monkeypatch.setattr(omni_base.StageConfigFactory, "create_from_model", lambda model, **kw: config)
    monkeypatch.setattr(omni_base, "AsyncOmniEngine", partial(AsyncOmniEngine, stage_client_factory=Streamer))

    async def run() -> tuple[dict[str, list[tuple[list[int], bool]]], int]:
        omni = AsyncOmni("s")
        batches = []
        deliver = omni._deliver
        omni._deliver = lambda batch: (batches.append(len(batch)), deliver(batch))

        async def one(rid: str) -> list[tuple[list[int], bool]]:
            return [(out.token_ids, out.finished) async for out in omni.generate("p", rid)]

        try:
            streams = await asyncio.wait_for(asyncio.gather(*(one(f"r{i}") for i in range(STREAMS))), timeout=30)
        finally:
            omni.close()
        return dict(enumerate(streams)), len(batches)

    streams, wakeups = asyncio.run(run())
    expected = [([i], i == TOKENS - 1) for i in range(TOKENS)]
    assert all(stream == expected for stream in streams.values())
    assert wakeups <= TOKENS * STREAMS // 4, wakeups
