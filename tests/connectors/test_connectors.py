"""Connectors: payloads arrive intact; shared memory is zero-copy for readers and leaves no /dev/shm
segment after the last reader, an abort (drop_request), an error during put, or close().
"""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch

from vllm_omni.config.deploy_config import ConnectorConfig
from vllm_omni.connectors import StagePayload, make_connector
from vllm_omni.connectors.shm_connector import SharedMemoryConnector, segment_prefix


def segments() -> set[str]:
    """This process's segments (other test processes on the machine write theirs meanwhile)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(segment_prefix())}


@pytest.fixture
def payload():
    return StagePayload(metadata={"text": "hi", "token_ids": [1, 2]},
                        tensors={"hidden": torch.randn(64, 1024), "codes": torch.arange(6, dtype=torch.int64),
                                 "bf16": torch.randn(300, 700).to(torch.bfloat16)})


@pytest.mark.parametrize("name", ["inproc", "shm"])
def test_roundtrip_and_refcount(name, payload):
    before = segments()
    conn = make_connector(ConnectorConfig(name=name, shm_threshold_bytes=1024))
    handle = conn.put("r", 0, 1, payload, num_readers=2)
    handle = pickle.loads(pickle.dumps(handle))  # handles are small and cross process boundaries
    for _ in range(2):
        got = conn.get(handle)
        assert got.metadata == payload.metadata
        for key, tensor in payload.tensors.items():
            assert torch.equal(got.tensors[key], tensor) and got.tensors[key].dtype == tensor.dtype
    with pytest.raises(KeyError, match="already consumed"):
        conn.get(handle)
    assert len(conn) == 0
    del got
    gc.collect()
    assert segments() == before
    conn.close()


def test_shm_reader_view_is_zero_copy_and_survives_unlink(payload):
    conn = SharedMemoryConnector(threshold_bytes=1024)
    handle = conn.put("r", 0, 1, payload)
    assert {spec[0] for spec in handle.tensor_specs} == {"hidden", "bf16"}  # small "codes" travel inline
    got = conn.get(handle)
    assert not segments() & {spec[1] for spec in handle.tensor_specs}  # names unlinked after the last reader
    view = got.tensors["hidden"]
    view[0, 0] = 123.0  # the mapping is still valid and writable
    assert view[0, 0].item() == 123.0
    again = SharedMemoryConnector.open_handle  # attaching by name needs the segment to still exist
    with pytest.raises(FileNotFoundError):
        again(handle)


def test_shm_drop_request_and_close_free_everything(payload):
    before = segments()
    conn = SharedMemoryConnector(threshold_bytes=1024)
    h1 = conn.put("a", 0, 1, payload)
    conn.put("a:b", 0, 1, payload)  # ids that share a prefix must not be confused
    other_process_view = SharedMemoryConnector.open_handle(h1)
    assert torch.equal(other_process_view.tensors["hidden"], payload.tensors["hidden"])
    conn.drop_request("a")
    assert len(conn) == 1
    conn.close()
    assert len(conn) == 0
    del other_process_view
    gc.collect()
    assert segments() == before


def test_shm_put_failure_leaves_nothing(payload):
    before = segments()
    conn = SharedMemoryConnector(threshold_bytes=1024)
    bad = StagePayload(tensors={"ok": torch.randn(1000), "bad": torch.randn(1000).to_sparse()})
    with pytest.raises(Exception):  # noqa: B017 - any failure while writing must clean up
        conn.put("r", 0, 1, bad)
    assert segments() == before and len(conn) == 0


def test_an_edge_between_stages_placed_apart_goes_through_rays_object_store():
    """On the Ray backend an edge whose two stages have different placements gets the ray connector (joining the
    deploy config's cluster); stages placed alike keep the configured one; an edge's own connector always wins."""
    from vllm_omni.config.deploy_config import DeployConfig

    stages = [{"stage_id": 1, "placement": {"resources": {"node_b": 1}}},
              {"stage_id": 2, "placement": {"resources": {"node_b": 1}}}]
    deploy = DeployConfig(worker_backend="ray", ray_address="127.0.0.1:6379", stages=stages,
                          connector=ConnectorConfig(name="shm"),
                          edge_connectors={"2->3": ConnectorConfig(name="inproc"), "3->4": ConnectorConfig(name="ray")})
    assert deploy.connector_for(0, 1) == ConnectorConfig(name="ray", ray_address="127.0.0.1:6379")
    assert deploy.connector_for(1, 2).name == "shm"  # both on node_b's placement
    assert deploy.connector_for(2, 3).name == "inproc"
    assert deploy.connector_for(3, 4) == ConnectorConfig(name="ray", ray_address="127.0.0.1:6379")
    assert deploy.connector_for(4, 5).name == "shm"  # neither placed: both on the serving host
    mp = DeployConfig(connector=ConnectorConfig(name="shm"))
    assert mp.connector_for(0, 1).name == "shm"
