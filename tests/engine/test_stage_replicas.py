"""Replica data parallelism of a stage: `data_parallel_size` resolves into replicas on disjoint devices, and
the pool dispatches to the least loaded serving replica, skipping dead and restarting ones.

The live contract (two diffusion replicas behind `vllm serve`, kill -9 of one) is
tests/reliability/test_diffusion_replicas.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.fakes import FakeStageClient
from vllm_omni.config.deploy_config import DeployConfig, StageDeployConfig
from vllm_omni.config.omni_config import StageConfigFactory
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.errors import OmniClientError


def test_data_parallel_size_is_the_diffusion_stage_replica_count():
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", data_parallel_size=2).stages
    assert stage.num_replicas == 2
    assert "data_parallel_size" not in stage.engine_args  # each replica is one whole engine


def test_replicas_get_disjoint_devices(tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - {stage_id: 0, devices: '0,1,2,3'}\n")
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", data_parallel_size=2,
                                                    deploy_config=str(deploy)).stages
    assert [stage.replica_devices(r) for r in range(2)] == ["0,1", "2,3"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"data_parallel_size": 3, "deploy_config": DeployConfig(stages=[StageDeployConfig(0, num_replicas=2)])},
     "data_parallel_size"),
    ({"data_parallel_size": 2, "deploy_config": DeployConfig(stages=[StageDeployConfig(0, devices="0,1,2")])},
     "devices"),
])
def test_bad_replica_settings_fail_at_resolution(kwargs, param):
    with pytest.raises(OmniClientError) as info:
        StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs)
    assert info.value.param == param


class Replica(FakeStageClient):
    restarting = False

    @property
    def is_restarting(self) -> bool:  # the fake's own is always False
        return self.restarting


async def _run(pool: StagePool, n: int) -> None:
    async def one(i: int) -> None:
        async for _ in pool.generate(f"r{i}", "p", None):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_requests_spread_over_serving_replicas_only():
    replicas = [Replica(stage_type="diffusion", delay=0.05) for _ in range(3)]
    pool = StagePool(0, replicas)
    await _run(pool, 8)
    assert sorted(pool.dispatched.values()) == [2, 3, 3]

    replicas[0].dead, replicas[1].restarting = True, True
    assert pool.replica_states() == ["dead", "restarting", "serving"]
    assert pool.is_degraded and pool.is_serving and not pool.is_dead
    before = dict(pool.dispatched)
    await _run(pool, 4)
    assert pool.dispatched[2] - before[2] == 4


async def test_a_restarting_replica_takes_requests_when_nothing_else_serves():
    replicas = [Replica(stage_type="diffusion"), Replica(stage_type="diffusion")]
    replicas[0].dead, replicas[1].restarting = True, True
    pool = StagePool(0, replicas)
    assert not pool.is_serving
    await _run(pool, 1)
    assert pool.dispatched == {1: 1}
