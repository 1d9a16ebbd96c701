"""OutputHandOff: what the orchestrator puts in one loop iteration reaches the subscriber's loop as one batch
(one cross-thread wake-up, not one per output), in order, nothing merged or lost; without a subscriber a
blocking reader gets the items one by one; a closed subscriber loop does not break the orchestrator.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from vllm_omni.engine.output_handoff import OutputHandOff


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

    assert asyncio.run(consume()) == iterations


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
