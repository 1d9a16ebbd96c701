"""The connector over Ray's object store, on the package's two-node loopback cluster.

What it pins: payloads put on node_a (this process, the engine's place) are read on node_b by another process
through the object store, intact (float32, bfloat16 and int64 tensors, metadata), a streamed edge's chunks in
the order they were put; the counters show what went through the store; in the producer's process a payload is
read `num_readers` times, then it (or an aborted request's, or everything on close) is gone, as on one host; a
payload whose producing process died fails its reader with an error naming it, instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.ray_cluster.clusters import PayloadStage, node_id, stage_payload
from vllm_omni.config.deploy_config import ConnectorConfig
from vllm_omni.connectors import StagePayload, make_connector
from vllm_omni.connectors.ray_connector import RayObjectStoreConnector


def _nbytes(payload: StagePayload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.tensors.values())


@pytest.fixture(scope="module")
def stage_b(ray_cluster):
    """One actor on node_b (no CPU reserved: the placement module's ranks need node_b's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = (
        ray.remote(PayloadStage)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id("node_b"), soft=False))
        .remote()
    )
    yield actor
    ray.kill(actor)


def test_payloads_cross_nodes_in_order_through_the_object_store(ray_cluster, stage_b):
    import ray

    conn = make_connector(ConnectorConfig(name="ray", ray_address=ray_cluster.address))
    assert isinstance(conn, RayObjectStoreConnector)
    sent = [stage_payload(i) for i in range(5)]
    handles = [conn.put("r", 0, 1, sent[0])]  # a whole output, then a streamed edge's chunks
    handles += [conn.put("r", 0, 2, payload, chunk=i) for i, payload in enumerate(sent[1:])]
    assert [h.key for h in handles] == ["r:0->1", *(f"r:0->2#{i}" for i in range(4))]
    assert conn.stats.payloads_put == 5 and conn.stats.bytes_put == sum(map(_nbytes, sent))

    node, got, payloads_got = ray.get(stage_b.take.remote(handles), timeout=120)
    assert node == node_id("node_b") != ray.get_runtime_context().get_node_id()
    assert payloads_got == 5
    for want, have in zip(sent, got, strict=True):
        assert have.metadata == want.metadata
        for name, tensor in want.tensors.items():
            assert have.tensors[name].dtype == tensor.dtype and torch.equal(have.tensors[name], tensor), name
    for handle in handles:  # the readers were elsewhere: the producer lets go once they took them
        conn.release(handle)
    assert len(conn) == 0
    conn.close()


def test_readers_abort_and_close_in_the_producer_as_on_one_host(ray_cluster):
    conn = RayObjectStoreConnector()
    handle = conn.put("r", 0, 1, stage_payload(0), num_readers=2)
    for _ in range(2):
        assert torch.equal(conn.get(handle).tensors["hidden"], stage_payload(0).tensors["hidden"])
    with pytest.raises(KeyError, match="already consumed"):
        conn.get(handle)
    dropped = conn.put("a", 0, 1, stage_payload(1))
    conn.put("a:b", 0, 1, stage_payload(2))  # ids that share a prefix must not be confused
    conn.drop_request("a")
    assert len(conn) == 1
    with pytest.raises(KeyError, match="already consumed or dropped"):
        conn.get(dropped)
    conn.close()
    assert len(conn) == 0 and conn.stats.payloads_put == 3 and conn.stats.payloads_got == 2


def test_a_payload_whose_producer_died_fails_its_reader(ray_cluster, stage_b):
    """The producer (on node_b) is lost after handing its payload on: the reader gets an error naming it."""
    import ray

    handle = ray.get(stage_b.produce.remote("lost"), timeout=60)
    ray.kill(stage_b, no_restart=True)
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):  # ray.kill returns before the actor is gone: a call sent
        while time.monotonic() < deadline:  # at once may still be served
            ray.get(stage_b.take.remote([]), timeout=60)
            time.sleep(0.1)
    with pytest.raises(RuntimeError, match=r"payload lost:1->2 is lost from Ray's object store"):
        RayObjectStoreConnector(get_timeout_s=30).get(handle)
