"""The OpenAI server as a Ray Serve application: two replicas of tiny/qwen-image behind Serve's one endpoint.

What it pins: the Serve config's application (`vllm_omni.entrypoints.openai.ray_serve:build_app`) starts
replicas that each run the server `vllm serve --omni` runs; 40 requests from the official `openai` client all
succeed and both replicas answer some (`x-omni-replica`); when one replica's actor process is killed mid-run only
the requests it was running fail, with 503, every other request succeeds meanwhile, and Serve has two running
replicas again within 60 s. Every socket the cluster's processes listen on is a loopback one.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml

from tests.ray_cluster.clusters import SERVE_APP as APP
from tests.ray_cluster.clusters import SERVE_RECIPE as RECIPE
from tests.ray_cluster.clusters import listening_off_loopback
from vllm_omni.entrypoints.openai.ray_serve import REPLICA_HEADER

_START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def endpoint(serve_app):
    """The package's Serve application once both replicas run: the proxy's URL and how long they took to start."""
    from ray import serve

    url, started = serve_app
    while (status := serve.status().applications[APP].status) != "RUNNING":
        assert status in ("NOT_STARTED", "DEPLOYING") and time.monotonic() < started + _START_TIMEOUT_S, status
        time.sleep(0.5)
    return url, time.monotonic() - started


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


@pytest.mark.parametrize("replica_answers", [True, False])
def test_proxy_middleware_answers_503_only_where_no_response_started(replica_answers):
    """What Serve's proxy does when a replica answers (its own 500 passes) and when its actor died (the proxy
    ends the call without a response: 503 with an OpenAI-style body)."""
    from starlette.testclient import TestClient

    from vllm_omni.entrypoints.openai.ray_serve_proxy import proxy_middlewares

    async def proxy(scope, receive, send):
        if replica_answers:
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"pipeline failed"})

    (middleware,) = proxy_middlewares()
    response = TestClient(middleware.cls(proxy)).post("/v1/images/generations", json={})
    if replica_answers:
        assert (response.status_code, response.text) == (500, "pipeline failed")
    else:
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"


def _generate(client: openai.OpenAI, steps: int = 2) -> str:
    raw = client.images.with_raw_response.generate(
        model="tiny/qwen-image", prompt="a red cube", size="32x32", extra_body={"num_inference_steps": steps, "seed": 1}
    )
    assert raw.parse().data[0].b64_json
    return raw.headers[REPLICA_HEADER]


def _replica_tags() -> set[str]:
    """The replica ids of the application's live replica actors (what `x-omni-replica` answers)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#OmniServer#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return {actor["name"].removeprefix(prefix) for actor in named if actor["name"].startswith(prefix)}


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
    assert not listening_off_loopback()  # Serve's proxy and controller, the replicas and their engines' processes


@pytest.mark.slow
def test_killed_replica_fails_only_its_requests_with_503_and_comes_back(endpoint):
    """Four clients keep sending while one replica's actor process is killed: the requests in flight on it fail
    with 503 within 10 s (`ray_serve_proxy`: Serve's own answer would be a bare 500), every other request is
    served by the other replica meanwhile, and Serve has two running replicas again, one of them new and serving,
    within 60 s of the kill -- or, on a machine so loaded that starting the replicas took longer (here the
    replacement needs ~30 s for Ray's worker and imports plus ~30 s of engine start at load average 20+), within
    that start time."""
    import ray

    client = openai.OpenAI(base_url=endpoint[0], api_key="x", max_retries=0, timeout=120)
    victim = _generate(client)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#OmniServer#{victim}", namespace="serve")
    results: list[tuple[float, float, str | int]] = []  # (sent, answered, replica or error status)
    lost: list = []  # the OpenAI error objects of the failed requests
    stop = threading.Event()

    def keep_sending() -> None:
        while not stop.wait(0.5):  # requests in flight on both replicas, and CPU left for Serve's restart
            sent = time.monotonic()
            try:  # 20 steps: long enough that the victim still runs the request it was seen running at the kill
                outcome: str | int = _generate(client, steps=20)
            except openai.APIStatusError as exc:
                outcome = exc.status_code
                lost.append(exc.body["error"] if isinstance(exc.body, dict) and "error" in exc.body else exc.body)
            results.append((sent, time.monotonic(), outcome))

    senders = [threading.Thread(target=keep_sending) for _ in range(4)]
    for sender in senders:
        sender.start()
    time.sleep(3)
    deadline = time.monotonic() + 30
    while not ray.get(actor.get_num_ongoing_requests.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(0.01)  # kill it while it runs a request
    old_replicas = _replica_tags()  # a reply from none of these is from the replacement
    assert victim in old_replicas and len(old_replicas) == 2, old_replicas
    limit_s = max(60.0, endpoint[1])
    killed_at = time.monotonic()
    ray.kill(actor, no_restart=True)
    back_after = None
    while back_after is None and time.monotonic() < killed_at + limit_s:  # a replica Serve started after the kill
        time.sleep(0.5)
        if {o for _, _, o in results if isinstance(o, str)} - old_replicas and _running_replicas() == 2:
            back_after = time.monotonic() - killed_at
    stop.set()
    for sender in senders:
        sender.join(150)
    failed = [
        (sent - killed_at, answered - killed_at, status)
        for sent, answered, status in results
        if not isinstance(status, str)
    ]
    print(
        f"replicas started in {endpoint[1]:.1f} s, the killed one was back after {back_after} s; "
        f"{len(results)} requests, failed (sent, answered, status): {failed}"
    )
    assert back_after is not None, f"the killed replica was not back within {limit_s:.0f} s; failed: {failed}"
    # The victim answered `_generate` above; whether it also answered a sender before the kill is Serve's balancing.
    assert len(results) - len(failed) >= 10, results
    for sent, answered, status in failed:  # only the requests in flight on the victim, failing within 10 s
        assert sent < 0 <= answered < 10 and status == 503, (sent, answered, status)
    assert 1 <= len(failed) <= len(senders)
    assert all(error["type"] == "ServiceUnavailableError" and "died" in error["message"] for error in lost), lost
    assert any(sent > killed_at and isinstance(o, str) for sent, _, o in results if sent < killed_at + back_after)
