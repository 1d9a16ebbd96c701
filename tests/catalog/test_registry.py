"""Model resolution and the one model registry: where a checkpoint lives and which pipeline class serves it.

What it pins: `tiny/<name>` builds locally, a local dir passes through, an unreachable hub id fails with a
clear FileNotFoundError; `_class_name` picks the native pipeline, anything else (or the adapter flag) the
diffusers adapter; "module:Class" names a custom pipeline; modalities for native classes come from the family
spec and for adapter classes from the diffusers pipeline's declared output (HunyuanImage/CogView are images);
every built-in family's spec resolves without importing torch, and every name a spec holds resolves.
"""

from __future__ import annotations

import json

import pytest

from vllm_omni.catalog import resolution
from vllm_omni.catalog.registry import DIFFUSERS_ADAPTER, MODEL_REGISTRY
from vllm_omni.catalog.spec import import_target
from vllm_omni.diffusion.data import OmniDiffusionConfig


def test_tiny_and_local_dirs(tmp_path):
    tiny = resolution.resolve_model_dir("tiny/qwen-image")
    assert resolution.read_model_index(tiny)["_class_name"] == "QwenImagePipeline"
    assert resolution.resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor in the Hugging Face cache"):
        resolution.resolve_model_dir("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        resolution.resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        resolution.read_model_index(tmp_path)


def test_pipeline_class_from_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    config = OmniDiffusionConfig(model=str(tmp_path))
    name = resolution.resolve_pipeline_class_name(config, tmp_path)
    assert name == "StableDiffusionPipeline"
    assert MODEL_REGISTRY.pipeline_class_path(name) == DIFFUSERS_ADAPTER
    override = OmniDiffusionConfig(model=str(tmp_path), model_class_name="QwenImagePipeline")
    assert resolution.resolve_pipeline_class_name(override, tmp_path) == "QwenImagePipeline"


def test_native_adapter_and_custom_classes():
    assert MODEL_REGISTRY.load_pipeline_class("QwenImagePipeline").__name__ == "QwenImagePipeline"
    assert MODEL_REGISTRY.load_pipeline_class("QwenImagePipeline", use_diffusers_adapter=True).__name__ == (
        "DiffusersAdapterPipeline"
    )
    custom = "vllm_omni.models.diffusers_adapter.pipeline:DiffusersAdapterPipeline"
    assert MODEL_REGISTRY.load_pipeline_class(custom).supports_request_batch is False


@pytest.mark.parametrize(
    "name, modality",
    [("QwenImagePipeline", "image"), ("WanImageToVideoPipeline", "video"), ("StableDiffusionXLPipeline", "image"),
     ("HunyuanVideoPipeline", "video"), ("LTXPipeline", "video"), ("StableAudioPipeline", "audio"),
     ("HunyuanImagePipeline", "image"), ("CogView4Pipeline", "image"), ("CogVideoXPipeline", "video")],
)
def test_output_modality(name, modality):
    assert MODEL_REGISTRY.output_modality(name) == modality


def test_specs_are_light_and_every_name_resolves():
    import subprocess
    import sys

    code = ("import sys; from vllm_omni.catalog.registry import MODEL_REGISTRY; "
            "specs = list(MODEL_REGISTRY.specs()); assert 'torch' not in sys.modules, 'torch imported'; "
            "print(len(specs))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 5
    from vllm_omni.plugins import register_models

    register_models()  # what vLLM runs in every process before it resolves a model class
    for spec in MODEL_REGISTRY.specs():
        targets = [e.target for e in spec.diffusion_pipelines.values()]
        targets += [*spec.ar_models.values(), *spec.stage_input_processors.values(), *spec.output_collectors.values(),
                    *spec.tiny.values(), *spec.hf_configs.values(),
                    *([spec.topology] if isinstance(spec.topology, str) else [])]
        for target in targets:
            if isinstance(target, str):
                assert callable(import_target(target)), target
    assert MODEL_REGISTRY.ar_models() == {
        "Qwen3OmniMoeTalkerForConditionalGeneration":
            "vllm_omni.models.qwen3_omni.vllm_talker:Qwen3OmniMoeTalkerForConditionalGeneration",
        "Qwen3OmniMoeOmniThinkerForConditionalGeneration":
            "vllm_omni.models.qwen3_omni.vllm_thinker:Qwen3OmniMoeOmniThinkerForConditionalGeneration",
        "Qwen3TTSTalkerForConditionalGeneration":
            "vllm_omni.models.qwen3_tts.vllm_talker:Qwen3TTSTalkerForConditionalGeneration"}
    from transformers import AutoConfig

    assert AutoConfig.for_model("qwen3_tts").model_type == "qwen3_tts"  # the plugin registered the config class
