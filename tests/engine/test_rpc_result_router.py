"""RpcResultRouter / CorrelatedRpcClient: a result reaches exactly the caller waiting on its key; timeouts
carry the caller's message; a full request queue applies backpressure; close() unblocks waiters.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from vllm_omni.engine.messages import AbortRequestMessage, AbortResultMessage, ErrorMessage
from vllm_omni.engine.rpc_result_router import CorrelatedRpcClient, RpcResultRouter


def test_router_delivers_by_correlation_key():
    source: queue.Queue = queue.Queue()
    router = RpcResultRouter(source)
    waiter = router.register(("abort", "abort-42"))
    other = router.register(("abort", "other"))
    source.put(AbortResultMessage(rpc_id="abort-42", success=True))
    assert waiter.get(timeout=2).rpc_id == "abort-42"
    with pytest.raises(queue.Empty):
        other.get(timeout=0.05)
    router.close()


def test_router_ignores_uncorrelated_errors_broadcasts_fatal_and_close_unblocks():
    source: queue.Queue = queue.Queue()
    router = RpcResultRouter(source)
    w1 = router.register(("abort", "1"))
    source.put(ErrorMessage(error="one request failed", request_id="r"))
    with pytest.raises(queue.Empty):
        w1.get(timeout=0.1)
    source.put(ErrorMessage(error="engine died", fatal=True))
    assert w1.get(timeout=2).fatal
    w2 = router.register(("abort", "2"))
    threading.Timer(0.1, router.close).start()
    with pytest.raises(RuntimeError, match="closed"):
        w2.get(timeout=2)


def test_execute_timeout_uses_message():
    client = CorrelatedRpcClient(queue.Queue(), queue.Queue())
    with pytest.raises(TimeoutError, match="abort timed out after 0.1 seconds"):
        client.execute(("abort", "x"), AbortRequestMessage(request_ids=["r"], rpc_id="x"), timeout=0.1,
                       timeout_message="abort timed out after 0.1 seconds")
    client.close()


def test_execute_blocks_on_full_request_queue_until_space():
    requests: queue.Queue = queue.Queue(maxsize=1)
    results: queue.Queue = queue.Queue()
    requests.put("occupant")
    client = CorrelatedRpcClient(requests, results)
    out: list = []
    msg = AbortRequestMessage(request_ids=["r"], rpc_id="k")
    t = threading.Thread(target=lambda: out.append(client.execute(("abort", "k"), msg, timeout=5,
                                                                  timeout_message="t/o", block_on_submit=True)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and requests.qsize() == 1  # still blocked on the put
    assert requests.get() == "occupant"
    assert requests.get(timeout=2) is msg
    results.put(AbortResultMessage(rpc_id="k", success=True))
    t.join(timeout=5)
    assert out and out[0].success
    client.close()
