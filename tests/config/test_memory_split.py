"""AR stages that share a device split its memory when no stage sets its own (`_split_memory`).

Why it matters: each vLLM EngineCore takes vLLM's default `gpu_memory_utilization` (92% of the device; on CPU of
the host's memory for its KV cache), so `vllm serve tiny/qwen3-omni --omni` without memory flags failed at the
talker's start ("Available memory on node 0 (0.38/23.54 GiB) ... is less than requested memory for kv"). What it
pins: two AR stages on one device get half of the shared amount each, code2wav none; a stage's own
`gpu_memory_utilization` / `kv_cache_memory_bytes`, `VLLM_CPU_KVCACHE_SPACE` on CPU and AR stages on disjoint
devices are left as they are.
"""

from __future__ import annotations

import pytest

from vllm_omni.config import StageConfigFactory
from vllm_omni.config.deploy_config import DeployConfig, StageDeployConfig
from vllm_omni.config.omni_config import MEMORY_SHARED_BY_AR_STAGES


def utilizations(config) -> list[float | None]:
    return [s.engine_args.get("gpu_memory_utilization") for s in config.stages]


def test_two_ar_stages_on_cpu_split_half_the_host(omni_dir):
    half = MEMORY_SHARED_BY_AR_STAGES["cpu"] / 2
    assert utilizations(StageConfigFactory.create_from_model(str(omni_dir))) == [half, half, None]


def test_what_the_user_set_is_kept(omni_dir, monkeypatch):
    config = StageConfigFactory.create_from_model(str(omni_dir), gpu_memory_utilization=0.15)
    assert utilizations(config) == [0.15, 0.15, None]
    config = StageConfigFactory.create_from_model(str(omni_dir),
                                                  stage_overrides={"1": {"kv_cache_memory_bytes": 2**30}})
    assert utilizations(config)[1] is None and utilizations(config)[0] == MEMORY_SHARED_BY_AR_STAGES["cpu"] / 2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert utilizations(StageConfigFactory.create_from_model(str(omni_dir))) == [None, None, None]


@pytest.mark.parametrize(("devices", "expected"), [(("0", "0"), 0.46), (("0", "1"), None), ((None, "1"), 0.46)])
def test_on_an_accelerator_only_stages_on_one_device_split_it(omni_dir, monkeypatch, devices, expected):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    deploy = DeployConfig(stages=[StageDeployConfig(0, devices=devices[0]), StageDeployConfig(1, devices=devices[1])])
    config = StageConfigFactory.create_from_model(str(omni_dir), deploy_config=deploy)
    assert utilizations(config) == [expected, expected, None]
