"""The Ray package's one loopback cluster, shared by its modules (a cluster start costs 10-20 s of CI).

Ray binds to the loopback address in every test: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be set before ray
is first imported (otherwise Ray takes the default route's interface address for its GCS, raylets and object
store), so it is set here, at collection; so is `RAY_USAGE_STATS_ENABLED=0` (no usage report from a test
cluster, which could not reach the internet anyway).
"""

from __future__ import annotations

import os
import time

import pytest
import yaml

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="package")
def ray_cluster():
    """Two nodes: `node_a` (the head, 3 CPUs: Serve's replicas and the one replacing a killed replica) and
    `node_b` (4 CPUs: the diffusion stages' rank actors), this process joined as the driver. The two modules' work
    runs side by side (`_serve_deploys_first`) and neither waits for the other's CPUs."""
    import ray

    from tests.ray_cluster.clusters import start_cluster

    cluster = start_cluster({"node_a": 3, "node_b": 4})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def _cluster_on_loopback(request):
    """Every test on the cluster checks that its GCS is on the loopback address."""
    if "ray_cluster" in request.fixturenames:
        address = request.getfixturevalue("ray_cluster").gcs_address
        assert address.startswith("127."), address


@pytest.fixture(scope="package")
def serve_app(ray_cluster):
    """Serve's proxy on a free loopback port and the recipe's application, its deployment with 2 replicas of 1
    CPU on node_a; deployed without waiting for the replicas (`tests/ray_cluster/test_ray_serve.py::endpoint` waits).
    Yields the proxy's URL and when the deployment began."""
    from ray import serve
    from vllm.utils.network_utils import get_open_port

    from tests.ray_cluster.clusters import SERVE_APP, SERVE_RECIPE
    from vllm_omni.entrypoints.openai.ray_serve import OmniServer

    port = get_open_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    (spec,) = yaml.safe_load(SERVE_RECIPE.read_text())["applications"]
    (options,) = spec["deployments"]
    app = (
        serve.deployment(OmniServer)
        .options(
            num_replicas=2,
            ray_actor_options={**options["ray_actor_options"], "resources": {"node_a": 1}},
            health_check_period_s=options["health_check_period_s"],
        )
        .bind(**spec["args"])
    )
    started = time.monotonic()
    serve.run_many([serve.RunTarget(app, name=SERVE_APP, route_prefix="/")], wait_for_applications_running=False)
    yield f"http://127.0.0.1:{port}/v1", started
    serve.shutdown()


@pytest.fixture(scope="package", autouse=True)
def _serve_deploys_first(request):
    """Serve's replicas are the slowest thing here to start (each imports vLLM twice: the replica, then its
    stage's core process): when a selected test needs them, they start before the package's first test, beside
    the placement module's engines, instead of after them."""
    if any("serve_app" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("serve_app")
