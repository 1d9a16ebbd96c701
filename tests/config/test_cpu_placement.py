"""AR EngineCores sharing a CPU-only host get disjoint OpenMP CPU sets (vLLM's `VLLM_CPU_OMP_THREADS_BIND`)."""

from __future__ import annotations

import json
import os

import pytest

from vllm_omni.config import StageConfigFactory
from vllm_omni.config.deploy_config import split_cpus
from vllm_omni.engine.spawn_env import stage_environ
from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen3_omni.pipeline import qwen3_omni_pipeline


def fake_cpus(monkeypatch, n: int, smt: int = 1) -> None:
    from vllm.utils import cpu_resource_utils
    from vllm.utils.cpu_resource_utils import LogicalCPUInfo

    cpus = [LogicalCPUInfo(id=i, physical_core=i // smt, numa_node=0) for i in range(n)]
    monkeypatch.setattr(cpu_resource_utils, "get_allowed_cpu_list", lambda: cpus)


@pytest.mark.parametrize(("cpus", "smt", "parts", "expected"), [
    (2, 1, 2, ["0", "1"]),                      # the 2-core dev host: thinker core 0, talker core 1
    (3, 1, 2, ["0", "1"]),                      # one core left for the engine process
    (16, 1, 2, ["0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14"]),
    (8, 2, 2, ["0,2", "4"]),                    # one logical CPU per physical core (4 cores, 1 left over)
    (2, 1, 3, ["0", "1", "0"]),                 # more EngineCores than cores: shared round robin
])
def test_split_cpus(monkeypatch, cpus, smt, parts, expected):
    fake_cpus(monkeypatch, cpus, smt)
    assert split_cpus(parts) == expected


@pytest.mark.parametrize("stream", [True, False])
def test_qwen3_omni_ar_stages_get_their_own_cores(monkeypatch, omni_dir, stream):
    """Streamed and store-and-forward resolve to the same placement; code2wav is not an EngineCore."""
    fake_cpus(monkeypatch, 2)
    config = StageConfigFactory.create_from_model(str(omni_dir), pipeline_config=qwen3_omni_pipeline(stream))
    thinker, talker, code2wav = config.stages
    assert (thinker.cpu_threads_bind, talker.cpu_threads_bind) == (["0"], ["1"])
    assert talker.omp_env(0) == {"VLLM_CPU_OMP_THREADS_BIND": "1"} and not hasattr(code2wav, "cpu_threads_bind")


def test_the_environment_and_the_deploy_config_win(monkeypatch, omni_dir, tmp_path):
    fake_cpus(monkeypatch, 2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    config = StageConfigFactory.create_from_model(str(omni_dir))
    assert [s.omp_env(0) for s in config.stages[:2]] == [{}, {}]  # vLLM reads the user's variable
    deploy = tmp_path / "d.yaml"
    deploy.write_text("stages:\n  - {stage_id: 1, num_replicas: 2, cpu_threads_bind: '0-1'}\n")
    config = StageConfigFactory.create_from_model(str(omni_dir), deploy_config=str(deploy))
    assert config.stages[0].cpu_threads_bind is None and config.stages[1].cpu_threads_bind == ["0-1", "0-1"]


def test_cpu_threads_bind_on_a_stage_without_engine_core_is_refused(omni_dir, tmp_path):
    deploy = tmp_path / "d.yaml"
    deploy.write_text("stages:\n  - {stage_id: 2, cpu_threads_bind: '1'}\n")
    with pytest.raises(OmniClientError, match="stage 2: cpu_threads_bind applies to AR stages") as e:
        StageConfigFactory.create_from_model(str(omni_dir), deploy_config=str(deploy))
    assert e.value.param == "cpu_threads_bind"


def test_stage_environ_restores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with stage_environ({"VLLM_CPU_OMP_THREADS_BIND": "1"}):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


@pytest.mark.parametrize(("cpus", "reserved", "threads"), [(2, None, 1), (16, None, 1), (16, "4", 4)])
def test_qwen3_tts_decoder_gets_the_cpus_the_talker_leaves(monkeypatch, omni_dir, cpus, reserved, threads):
    """vLLM's `auto` binds the talker's worker to all cores but the reserved ones (one by default,
    VLLM_CPU_NUM_OF_RESERVED_CPU): the engine process, which runs the speech decoder, gets those."""
    from vllm_omni.models.qwen3_tts.pipeline import qwen3_tts_pipeline

    fake_cpus(monkeypatch, cpus)
    if reserved is None:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    talker, decoder = StageConfigFactory.create_from_model(str(omni_dir),
                                                           pipeline_config=qwen3_tts_pipeline(True)).stages
    assert decoder.torch_num_threads == threads and not hasattr(talker, "torch_num_threads")


def test_torch_threads_split_over_the_computing_processes(monkeypatch, omni_dir, tmp_path):
    fake_cpus(monkeypatch, 16)
    *_, code2wav = StageConfigFactory.create_from_model(str(omni_dir)).stages
    assert code2wav.torch_num_threads == 1  # thinker 0-7, talker 8-14 (`split_cpus`): core 15 is left
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM's workers float: nothing to subtract
    *_, code2wav = StageConfigFactory.create_from_model(str(omni_dir)).stages
    assert code2wav.torch_num_threads == 16
    dit = tmp_path / "dit"
    dit.mkdir()
    (dit / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    (stage,) = StageConfigFactory.create_from_model(str(dit), tensor_parallel_size=2, cfg_parallel_size=2).stages
    assert stage.torch_num_threads == 4 and stage.make_od_config().torch_num_threads == 4  # 4 ranks on 16 CPUs
    (stage,) = StageConfigFactory.create_from_model(str(dit), torch_num_threads=3).stages
    assert stage.torch_num_threads == 3 and "torch_num_threads" in stage.engine_args
    with pytest.raises(OmniClientError, match="must be a positive integer") as e:
        StageConfigFactory.create_from_model(str(dit), torch_num_threads=0)
    assert e.value.param == "torch_num_threads"
