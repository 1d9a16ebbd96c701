"""Diffusion ranks as Ray actors (`--worker-backend ray`) on a two-node loopback cluster.

What it pins: a stage's CFG-parallel (Qwen-Image) and Ulysses (Wan) ranks run as Ray actors in one placement
group on the node its `placement` names and give the single-rank output (PSNR >= 60 dB), their world's rendezvous
listening on the node's (loopback) address only; the deploy config's
`worker_backend` / `ray_address` / `stages[].placement` and their flags reach the stage; a bad `--ray-address` and
a placement no node has fail at start-up with one line naming the flag or the stage, before any process starts;
a killed rank actor fails its request with 503 and the stage starts its ranks again.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.diffusion.distributed.parallel_jobs import psnr, run_pipeline
from tests.ray_cluster.clusters import listening_off_loopback, node_id
from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig, RayPlacement
from vllm_omni.errors import StageRestartingError

CASES = {
    "qwen-image-cfg2": (
        "qwen-image",
        {"cfg_parallel_size": 2},
        {"prompt": "a red cube on a table", "negative_prompt": "blurry"},
        dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0, output_type="np"),
    ),
    "wan-ulysses2": (
        "wan2.1-t2v",
        {"ulysses_degree": 2},
        {"prompt": "a cat walks", "negative_prompt": "blurry"},
        dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=0, max_sequence_length=16),
    ),
}


def test_cluster_is_on_loopback(ray_cluster):
    """Every node's address and every socket the cluster's processes listen on are loopback ones."""
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert not listening_off_loopback()


def _engine(cluster, model: str, parallel: dict):
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    return DiffusionEngine(
        OmniDiffusionConfig(
            model=model,
            parallel_config=DiffusionParallelConfig(**parallel),
            ray=RayPlacement(address=cluster.address, resources={"node_b": 1}),
        )
    )


def _run(engine, prompt: dict, params: dict, request_id: str):
    return engine.submit(_request(prompt, params, request_id)).result(120)


@pytest.fixture(scope="module")
def qwen_cfg2(ray_cluster):
    """Qwen-Image with CFG parallel 2, both ranks Ray actors on node_b (the restart test reuses it)."""
    from vllm_omni.catalog.tiny import build_tiny

    engine = _engine(ray_cluster, str(build_tiny("qwen-image")), CASES["qwen-image-cfg2"][1])
    yield engine
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_parallel_ranks_as_ray_actors_equal_one_rank(ray_cluster, dist_world, qwen_cfg2, case):
    from vllm_omni.catalog.tiny import build_tiny

    name, parallel, prompt, params = CASES[case]
    model = str(build_tiny(name))
    want = run_pipeline(model, {}, prompt, params)
    engine = qwen_cfg2 if name == "qwen-image" else _engine(ray_cluster, model, parallel)
    try:
        ranks = engine.executor.processes
        assert len(ranks) == 2 and {rank.node_id for rank in ranks} == {node_id("node_b")}
        out = _run(engine, prompt, params, case)
        # The ranks' world met at rank 0's node address (its TCP store listens there, not on every interface).
        assert not listening_off_loopback()
    finally:
        if engine is not qwen_cfg2:
            engine.close()
    assert out.error is None, out.error
    got = np.asarray(out.output["video"] if isinstance(out.output, dict) else out.output, dtype=np.float64)
    assert want["output"].std() > 0
    assert psnr(got, want["output"]) >= 60.0


@pytest.mark.slow
def test_a_killed_rank_fails_its_request_and_the_stage_restarts_its_ranks(qwen_cfg2):
    """A rank's actor killed mid-request (its node lost): the request fails with 503 at once, the stage's ranks
    start again in a new placement group, and the next request is served (waiting for the restart is bounded by
    the engine's own start-up time on a loaded machine, not a fixed sleep)."""
    import ray

    _, _, prompt, params = CASES["qwen-image-cfg2"]
    old = qwen_cfg2.executor
    future = qwen_cfg2.submit(_request(prompt, {**params, "num_inference_steps": 100_000}, "long"))
    time.sleep(1)
    ray.kill(old.processes[1].actor, no_restart=True)
    with pytest.raises(StageRestartingError, match="rank 1 .* died") as failed:
        future.result(30)
    assert failed.value.status_code == 503
    deadline = time.monotonic() + 180
    while qwen_cfg2.is_restarting and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not qwen_cfg2.is_restarting and not qwen_cfg2.is_dead
    assert _run(qwen_cfg2, prompt, params, "after").error is None
    assert qwen_cfg2.executor is not old and old._placement_group is None
    assert {rank.node_id for rank in qwen_cfg2.executor.processes} == {node_id("node_b")}


def _request(prompt: dict, params: dict, request_id: str):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), request_id)


def test_deploy_config_placement_reaches_the_stage():
    from vllm_omni.config.deploy_config import DeployConfig, PlacementConfig, StageDeployConfig
    from vllm_omni.config.omni_config import StageConfigFactory
    from vllm_omni.errors import OmniClientError

    deploy = DeployConfig(stages=[StageDeployConfig(stage_id=0, placement=PlacementConfig(resources={"gpu_a": 1}))])
    config = StageConfigFactory.create_from_model(
        "tiny/qwen-image", deploy_config=deploy, worker_backend="ray", ray_address="127.0.0.1:6379", cfg_parallel_size=2
    )
    assert config.stages[0].make_od_config().ray == RayPlacement(
        address="127.0.0.1:6379", resources={"gpu_a": 1}, strategy="STRICT_PACK"
    )
    mp = StageConfigFactory.create_from_model("tiny/qwen-image")
    assert mp.stages[0].make_od_config().ray is None
    with pytest.raises(OmniClientError, match="stage 0: placement needs --worker-backend ray"):
        StageConfigFactory.create_from_model("tiny/qwen-image", deploy_config=deploy)


_START = """
import sys
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.config.deploy_config import DeployConfig, PlacementConfig, StageDeployConfig
deploy = DeployConfig(stages=[StageDeployConfig(stage_id=0, placement=PlacementConfig(resources={{"node_c": 1}}))])
for kwargs in ({{"ray_address": "127.0.0.1:1"}}, {{"ray_address": {address!r}, "deploy_config": deploy}}):
    try:
        Omni(model="tiny/qwen-image", worker_backend="ray", stage_init_timeout=60, **kwargs)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc))
    else:
        sys.exit("started")
"""


@pytest.mark.slow
def test_bad_address_and_unsatisfiable_placement_fail_at_start_up_in_one_line(ray_cluster):
    proc = subprocess.run(
        [sys.executable, "-c", _START.format(address=ray_cluster.address)], capture_output=True, text=True, timeout=180
    )
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 0 and len(errors) == 2, proc.stdout + proc.stderr[-3000:]
    bad_address, no_node = errors
    assert "--ray-address '127.0.0.1:1': no Ray cluster answers there" in bad_address
    assert "stage 0: placement {'CPU': 1.0, 'node_c': 1.0} x 1 rank(s) (STRICT_PACK) fits no node" in no_node
