"""Local multi-node Ray clusters for the tests: `ray.cluster_utils.Cluster` nodes on this machine, loopback only."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported (also set by conftest.py)

_OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Ray's minimum is 75 MiB; the tests move a few MiB at most."""


def start_cluster(nodes: dict[str, int]):
    """One Ray node per entry, each with `count` CPUs and the custom resource `name: count`; the first is the
    head. Returns the `Cluster` once every node is up, its GCS on 127.x; the caller shuts it down."""
    from ray.cluster_utils import Cluster

    (head, head_cpus), *others = nodes.items()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "resources": {head: head_cpus},
            "object_store_memory": _OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    for name, cpus in others:
        cluster.add_node(num_cpus=cpus, resources={name: cpus}, object_store_memory=_OBJECT_STORE_BYTES)
    cluster.wait_for_nodes(timeout=60)
    assert cluster.gcs_address.startswith("127."), cluster.gcs_address
    return cluster


def node_id(resource: str) -> str:
    """The id of the (alive) node that has the custom resource `resource`."""
    import ray

    (found,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return found
