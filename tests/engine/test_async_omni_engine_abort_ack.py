"""AsyncOmniEngine abort: fire-and-forget enqueues without rpc id; abort_async waits for the matching ack,
raises the stage's error, times out with a clear message, and respects request-queue backpressure.
"""

from __future__ import annotations

import asyncio
import threading

import janus
import pytest

from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.messages import AbortRequestMessage, AbortResultMessage, CollectiveRPCResultMessage
from vllm_omni.engine.rpc_result_router import CorrelatedRpcClient


@pytest.fixture
def engine():
    """An engine with its queues and RPC client but no stages (the orchestrator side is played by the test)."""
    eng = AsyncOmniEngine.__new__(AsyncOmniEngine)
    eng.request_queue = janus.Queue(maxsize=1)
    eng.rpc_output_queue = janus.Queue()
    eng._correlated_rpc_client = CorrelatedRpcClient(eng.request_queue.sync_q, eng.rpc_output_queue.sync_q)
    yield eng
    eng._correlated_rpc_client.close()


def test_correlation_key():
    assert AbortResultMessage(rpc_id="abc", success=True).rpc_correlation_key == ("abort", "abc")


def test_sync_abort_is_fire_and_forget(engine):
    engine.abort(["req-1"])
    assert engine.request_queue.sync_q.get_nowait() == AbortRequestMessage(request_ids=["req-1"], rpc_id=None)
    assert engine.rpc_output_queue.sync_q.empty()


async def _answer(engine, result_factory):
    msg = await asyncio.to_thread(engine.request_queue.sync_q.get, True, 5)
    assert isinstance(msg, AbortRequestMessage) and len(msg.rpc_id) == 32
    engine.rpc_output_queue.sync_q.put(result_factory(msg.rpc_id))


async def test_abort_async_waits_for_matching_ack(engine):
    task = asyncio.create_task(engine.abort_async(["r"], timeout=5))
    await asyncio.sleep(0.1)
    assert not task.done()
    engine.rpc_output_queue.sync_q.put(AbortResultMessage(rpc_id="someone-else", success=True))
    await asyncio.sleep(0.1)
    assert not task.done()
    await _answer(engine, lambda rid: AbortResultMessage(rpc_id=rid, success=True))
    await asyncio.wait_for(task, 5)


async def test_abort_async_raises_stage_error(engine):
    task = asyncio.create_task(engine.abort_async(["r"], timeout=5))
    await _answer(engine, lambda rid: AbortResultMessage(rpc_id=rid, success=False, error="stage abort failed"))
    with pytest.raises(RuntimeError, match="stage abort failed"):
        await task


async def test_abort_async_times_out(engine):
    with pytest.raises(TimeoutError, match="abort timed out"):
        await engine.abort_async(["r"], timeout=0.2)


async def test_abort_async_rejects_unexpected_result_type(engine):
    task = asyncio.create_task(engine.abort_async(["r"], timeout=5))

    class Odd(CollectiveRPCResultMessage, kw_only=True):
        @property
        def rpc_correlation_key(self):
            return ("abort", self.rpc_id)

    await _answer(engine, lambda rid: Odd(rpc_id=rid))
    with pytest.raises(RuntimeError, match="unexpected abort result type"):
        await task


async def test_abort_async_blocks_on_full_queue(engine):
    engine.request_queue.sync_q.put("occupant")
    task = asyncio.create_task(engine.abort_async(["r"], timeout=5))
    await asyncio.sleep(0.2)
    assert not task.done() and engine.request_queue.sync_q.qsize() == 1
    assert engine.request_queue.sync_q.get_nowait() == "occupant"
    await _answer(engine, lambda rid: AbortResultMessage(rpc_id=rid, success=True))
    await asyncio.wait_for(task, 5)


def test_abort_without_queue_raises():
    eng = AsyncOmniEngine.__new__(AsyncOmniEngine)
    eng.request_queue = None
    with pytest.raises(RuntimeError, match="request_queue is not initialized"):
        eng.abort(["x"])
    with pytest.raises(RuntimeError, match="correlated RPC client is not initialized"):
        asyncio.run(eng.abort_async(["x"]))


def test_no_thread_leak(engine):
    assert all(t.name != "OmniOrchestrator" for t in threading.enumerate())
