"""Local multi-node Ray clusters for the tests: `ray.cluster_utils.Cluster` nodes on this machine, loopback only."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported (also set by conftest.py)

SERVE_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "ray_serve_qwen_image.yaml"
SERVE_APP = "vllm-omni"
"""The Serve config the tests deploy (its application's name)."""

_OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Ray's minimum is 75 MiB; the tests move a few MiB at most."""

_QUIET_NODE = {"include_log_monitor": False, "object_store_memory": _OBJECT_STORE_BYTES}
"""No log monitor (the driver takes no worker logs: `log_to_driver=False`): one Python process less per node."""


def start_cluster(nodes: dict[str, int]):
    """One Ray node per entry, each with `count` CPUs and the custom resource `name: count`; the first is the
    head (no dashboard, no autoscaler monitor). Every node's processes get the Serve proxy callback that answers a
    request lost with its replica 503, as docs/scale_out.md starts a Serve cluster's nodes. Returns the `Cluster`
    once every node is up, its GCS on 127.x; the caller shuts it down."""
    from ray.cluster_utils import Cluster

    from vllm_omni.entrypoints.openai.ray_serve_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    node = {**_QUIET_NODE, "env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}
    (head, head_cpus), *others = nodes.items()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node,
            "num_cpus": head_cpus,
            "resources": {head: head_cpus},
            "include_dashboard": False,
            "no_monitor": True,
        },
    )
    for name, cpus in others:
        cluster.add_node(**node, num_cpus=cpus, resources={name: cpus})
    cluster.wait_for_nodes(timeout=60)
    assert cluster.gcs_address.startswith("127."), cluster.gcs_address
    return cluster


def node_id(resource: str) -> str:
    """The id of the (alive) node that has the custom resource `resource`."""
    import ray

    (found,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return found


def listening_off_loopback() -> list[tuple[str, int, str, int]]:
    """The TCP sockets that this process and every process under it (the cluster's GCS, raylets, agents and
    workers, and what those started) listen on at an address other than the loopback one: (process name, pid,
    address, port) each. One is left out: a Serve replica's inter-deployment gRPC server, which Ray Serve 2.60
    binds to `[::]:0` whatever the node's address (serve/_private/replica.py, no setting); nothing connects to
    it here (requests reach replicas through the proxy's actor calls)."""
    import psutil

    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for sock in sockets:
            if sock.status != psutil.CONN_LISTEN:
                continue
            address = ipaddress.ip_address(sock.laddr.ip)
            address = getattr(address, "ipv4_mapped", None) or address
            serve_grpc = proc.name().startswith("ray::ServeReplica") and sock.laddr.ip == "::"
            if not address.is_loopback and not serve_grpc:
                found.append((proc.name(), proc.pid, sock.laddr.ip, sock.laddr.port))
    return found


class PayloadStage:
    """A stage's process on another node for `test_ray_connector.py` (an actor's class must be importable where it
    runs): reads payloads put elsewhere through Ray's object store, or puts its own."""

    def __init__(self) -> None:
        from vllm_omni.connectors.ray_connector import RayObjectStoreConnector

        self.connector = RayObjectStoreConnector()

    def take(self, handles: list) -> tuple[str, list, int]:
        import ray

        payloads = [self.connector.get(handle) for handle in handles]
        return ray.get_runtime_context().get_node_id(), payloads, self.connector.stats.payloads_got

    def produce(self, request_id: str):
        return self.connector.put(request_id, 1, 2, stage_payload(7))


def stage_payload(seed: int):
    """A payload of float32, bfloat16 and int64 tensors, drawn from `seed`."""
    import torch

    from vllm_omni.connectors import StagePayload

    g = torch.Generator().manual_seed(seed)
    return StagePayload(
        metadata={"text": f"chunk {seed}", "token_ids": [seed, seed + 1]},
        tensors={
            "hidden": torch.randn(64, 1024, generator=g),
            "bf16": torch.randn(30, 70, generator=g).to(torch.bfloat16),
            "codes": torch.arange(seed, seed + 6),
        },
    )
