"""Config layers: the graph comes from the pipeline, placement from the deploy config, and overrides are
applied once with per-stage > global > deploy > pipeline precedence. Unknown keys fail loudly, naming the key.
"""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import ValidationError

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.config import (
    DeployConfig,
    PipelineConfig,
    StageConfigFactory,
    StageExecutionType,
    VllmOmniARStageConfig,
    VllmOmniDiffusionStageConfig,
    register_pipeline,
)
from vllm_omni.errors import OmniClientError

TWO_STAGE_YAML = """
name: rewrite-then-draw
stages:
  - stage_id: 0
    execution_type: ar
    engine_args: {max_model_len: 256, max_num_seqs: 4}
  - stage_id: 1
    execution_type: diffusion
    model: {diffusion_dir}
    inputs: [0]
    input_processor: text_to_prompt
    final_output: true
    final_output_type: image
"""


@pytest.fixture
def lm_dir(tmp_path):
    d = tmp_path / "lm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    return d


@pytest.fixture
def diffusion_dir(tmp_path):
    d = tmp_path / "dit"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return d


def test_plain_causal_lm_is_one_ar_stage(lm_dir):
    config = StageConfigFactory.create_from_model(str(lm_dir), max_model_len=128)
    assert config.stage_types == ["llm"]
    (stage,) = config.stages
    assert isinstance(stage, VllmOmniARStageConfig)
    assert stage.final_output and stage.engine_args == {"max_model_len": 128}


def test_model_index_is_one_diffusion_stage(diffusion_dir):
    config = StageConfigFactory.create_from_model(str(diffusion_dir), num_gpus=1, init_timeout=30)
    (stage,) = config.stages
    assert isinstance(stage, VllmOmniDiffusionStageConfig)
    assert stage.engine_args == {"num_gpus": 1, "init_timeout": 30}
    assert config.init_timeout == 30
    assert stage.make_od_config().init_timeout == 30


def test_precedence_pipeline_deploy_global_stage(tmp_path, lm_dir, diffusion_dir):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(TWO_STAGE_YAML.replace("{diffusion_dir}", str(diffusion_dir)))
    deploy = tmp_path / "d.yaml"
    deploy.write_text("stages:\n  - {stage_id: 0, num_replicas: 2,\n"
                      "     engine_args: {max_num_seqs: 8, max_model_len: 512}}\n"
                      "connector: {name: shm, shm_threshold_bytes: 10}\nstage_init_timeout: 42\n")
    config = StageConfigFactory.create_from_model(
        str(lm_dir), pipeline_config=str(pipeline), deploy_config=str(deploy),
        max_model_len=1024, enforce_eager=True, stage_overrides='{"0": {"max_model_len": 2048}}')
    ar, dit = config.stages
    # pipeline (256) < deploy (512) < global (1024) < per-stage override (2048)
    assert ar.engine_args == {"max_model_len": 2048, "max_num_seqs": 8, "enforce_eager": True}
    # global args go only to stages that understand them; enforce_eager is both an AR and a diffusion knob
    assert dit.engine_args == {"enforce_eager": True}
    assert ar.num_replicas == 2 and dit.num_replicas == 1 and ar.stage_init_timeout == 42
    assert dit.model == str(diffusion_dir) and dit.inputs == [0] and dit.input_processor == "text_to_prompt"
    assert config.connector_for(0, 1).name == "shm" and config.connector_for(0, 1).shm_threshold_bytes == 10


def test_resolved_config_is_transport_safe(lm_dir):
    config = StageConfigFactory.create_from_model(str(lm_dir), stage_overrides={0: {"max_num_seqs": 2}})
    clone = pickle.loads(pickle.dumps(config))
    assert clone == config and clone.stages[0].engine_args == {"max_num_seqs": 2}


def test_unknown_global_arg_names_it(lm_dir):
    with pytest.raises(OmniClientError, match="bogus_knob") as info:
        StageConfigFactory.create_from_model(str(lm_dir), bogus_knob=1)
    assert info.value.param == "bogus_knob"


def test_unknown_stage_override_names_stage_and_key(lm_dir):
    with pytest.raises(OmniClientError, match=r"stage 0 \(ar\).*num_inference_steps"):
        StageConfigFactory.create_from_model(str(lm_dir), stage_overrides={"0": {"num_inference_steps": 3}})


def test_override_for_missing_stage_is_rejected(lm_dir):
    with pytest.raises(OmniClientError, match=r"stage id\(s\) \[3\]"):
        StageConfigFactory.create_from_model(str(lm_dir), stage_overrides={"3": {"max_num_seqs": 2}})


def test_pipeline_yaml_unknown_key_and_bad_edges(tmp_path):
    with pytest.raises(ValidationError, match="colour"):
        PipelineConfig(name="x", stages=[{"stage_id": 0, "execution_type": "ar", "final_output": True,
                                          "colour": "red"}])
    with pytest.raises(ValueError, match="must be earlier stages"):
        PipelineConfig(name="x", stages=[{"stage_id": 0, "execution_type": "ar", "inputs": [0],
                                          "input_processor": "text_to_prompt", "final_output": True}])
    with pytest.raises(ValueError, match="no input_processor"):
        PipelineConfig(name="x", stages=[{"stage_id": 0, "execution_type": "ar"},
                                         {"stage_id": 1, "execution_type": "ar", "inputs": [0],
                                          "final_output": True}])
    with pytest.raises(ValueError, match="final_output"):
        PipelineConfig(name="x", stages=[{"stage_id": 0, "execution_type": "ar"}])
    with pytest.raises(ValidationError, match="replicas"):
        DeployConfig(stages=[{"stage_id": 0, "replicas": 2}])


def test_registered_pipeline_wins_for_its_architecture(lm_dir, monkeypatch):
    monkeypatch.setattr(MODEL_REGISTRY, "_entries", dict(MODEL_REGISTRY._entries))

    @register_pipeline("Qwen2ForCausalLM")
    def two_ar() -> PipelineConfig:
        return PipelineConfig(name="two-ar", stages=[
            {"stage_id": 0, "execution_type": StageExecutionType.AR},
            {"stage_id": 1, "execution_type": StageExecutionType.AR, "inputs": [0],
             "input_processor": "token_ids_to_prompt", "final_output": True}])

    config = StageConfigFactory.create_from_model(str(lm_dir))
    assert config.pipeline_name == "two-ar" and config.stage_types == ["llm", "llm"]
    assert config.connector_for(0, 1).name == "inproc"


def test_bundled_deploy_config_is_found_by_name():
    deploy = DeployConfig.from_yaml("cpu_default")
    assert deploy.connector.name in ("inproc", "shm")
