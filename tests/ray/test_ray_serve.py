"""The OpenAI server as a Ray Serve application: two replicas of tiny/qwen-image behind Serve's one endpoint.

What it pins: the Serve config's application (`vllm_omni.entrypoints.openai.ray_serve:build_app`) starts
replicas that each run the server `vllm serve --omni` runs; 40 requests from the official `openai` client all
succeed and both replicas answer some (`x-omni-replica`); when one replica's actor process is killed mid-run only
the requests it was running fail (a 5xx), every other request succeeds meanwhile, and Serve has two running
replicas again within 60 s.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from tests.ray.clusters import start_cluster
from vllm_omni.entrypoints.openai.ray_serve import REPLICA_HEADER

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "ray_serve_qwen_image.yaml"
APP = "vllm-omni"


@pytest.fixture(scope="module")
def endpoint():
    """Serve on a one-node loopback cluster, the recipe's application and deployment with 2 replicas of 1 CPU."""
    import ray
    from ray import serve
    from vllm.utils.network_utils import get_open_port

    from vllm_omni.entrypoints.openai.ray_serve import OmniServer

    cluster = start_cluster({"node_a": 3})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    port = get_open_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    (spec,) = yaml.safe_load(RECIPE.read_text())["applications"]
    (options,) = spec["deployments"]
    app = (
        serve.deployment(OmniServer)
        .options(
            num_replicas=2,
            ray_actor_options=options["ray_actor_options"],
            health_check_period_s=options["health_check_period_s"],
        )
        .bind(**spec["args"])
    )
    started = time.monotonic()
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}/v1", time.monotonic() - started
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_recipe_is_a_serve_config_of_the_application():
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from vllm_omni.entrypoints.openai.ray_serve import build_app

    config = ServeDeploySchema.parse_obj(yaml.safe_load(RECIPE.read_text()))
    (spec,) = config.applications
    assert spec.import_path == "vllm_omni.entrypoints.openai.ray_serve:build_app" and spec.name == APP
    assert isinstance(build_app(spec.args), Application)
    with pytest.raises(ValueError, match="takes args"):
        build_app({"modle": "tiny/qwen-image"})


def _generate(client: openai.OpenAI) -> str:
    raw = client.images.with_raw_response.generate(
        model="tiny/qwen-image", prompt="a red cube", size="32x32", extra_body={"num_inference_steps": 2, "seed": 1}
    )
    assert raw.parse().data[0].b64_json
    return raw.headers[REPLICA_HEADER]


def _running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["OmniServer"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_forty_requests_reach_both_replicas(endpoint):
    client = openai.OpenAI(base_url=endpoint[0], api_key="x", max_retries=0, timeout=120)
    with ThreadPoolExecutor(8) as pool:
        replicas = list(pool.map(lambda _: _generate(client), range(40)))
    assert len(replicas) == 40 and len(set(replicas)) == 2, replicas


@pytest.mark.slow
def test_killed_replica_fails_only_its_requests_and_comes_back(endpoint):
    """Back within 60 s, or on a machine so loaded that starting the replicas took longer, within that time."""
    import ray

    url, start_s = endpoint
    limit_s = max(60.0, start_s)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    victim = _generate(client)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#OmniServer#{victim}", namespace="serve")
    results: list[tuple[float, float, str | int]] = []  # (sent, answered, replica or error status)
    stop = threading.Event()

    def keep_sending() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                outcome: str | int = _generate(client)
            except openai.APIStatusError as exc:
                outcome = exc.status_code
            results.append((sent, time.monotonic(), outcome))

    senders = [threading.Thread(target=keep_sending) for _ in range(4)]
    for sender in senders:
        sender.start()
    time.sleep(3)
    before = {outcome for _, _, outcome in results if isinstance(outcome, str)}
    killed_at = time.monotonic()
    ray.kill(actor, no_restart=True)
    back_after = None
    while back_after is None and time.monotonic() < killed_at + limit_s:  # a replica Serve started after the kill
        time.sleep(0.5)
        if {o for _, _, o in results if isinstance(o, str)} - before and _running_replicas() == 2:
            back_after = time.monotonic() - killed_at
    stop.set()
    for sender in senders:
        sender.join(150)
    assert back_after is not None, f"the killed replica was not back within {limit_s:.0f} s"
    failed = [
        (sent - killed_at, answered - killed_at, status)
        for sent, answered, status in results
        if not isinstance(status, str)
    ]
    print(
        f"replicas started in {start_s:.1f} s, the killed one was back after {back_after:.1f} s; "
        f"{len(results)} requests, failed (sent, answered, status): {failed}"
    )
    assert victim in before and len(results) - len(failed) >= 10, results
    for sent, answered, status in failed:  # only the requests in flight on the victim, failing within 10 s
        assert sent < 0 <= answered < 10 and status >= 500, (sent, answered, status)
    assert len(failed) <= len(senders)
    assert any(sent > killed_at and isinstance(o, str) for sent, _, o in results if sent < killed_at + back_after)
