"""Model resolution: where a checkpoint lives and which pipeline class serves it.

What it pins: `tiny/<name>` builds locally, a local dir passes through, an unreachable hub id fails with a
clear FileNotFoundError; `_class_name` picks the native pipeline, anything else (or the adapter flag) the
diffusers adapter; "module:Class" names a custom pipeline; modalities for native and adapter classes.
"""

from __future__ import annotations

import json

import pytest

from vllm_omni.diffusion import registry
from vllm_omni.diffusion.data import OmniDiffusionConfig


def test_tiny_and_local_dirs(tmp_path):
    tiny = registry.resolve_model_dir("tiny/qwen-image")
    assert registry.read_model_index(tiny)["_class_name"] == "QwenImagePipeline"
    assert registry.resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor in the Hugging Face cache"):
        registry.resolve_model_dir("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        registry.resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        registry.read_model_index(tmp_path)


def test_pipeline_class_from_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    config = OmniDiffusionConfig(model=str(tmp_path))
    name = registry.resolve_pipeline_class_name(config, tmp_path)
    assert name == "StableDiffusionPipeline"
    assert registry.pipeline_class_path(name) == registry.DIFFUSERS_ADAPTER
    override = OmniDiffusionConfig(model=str(tmp_path), model_class_name="QwenImagePipeline")
    assert registry.resolve_pipeline_class_name(override, tmp_path) == "QwenImagePipeline"


def test_native_adapter_and_custom_classes():
    assert registry.load_pipeline_class("QwenImagePipeline").__name__ == "QwenImagePipeline"
    assert registry.load_pipeline_class("QwenImagePipeline", use_diffusers_adapter=True).__name__ == (
        "DiffusersAdapterPipeline"
    )
    custom = "vllm_omni.diffusion.models.diffusers_adapter.pipeline_diffusers_adapter:DiffusersAdapterPipeline"
    assert registry.load_pipeline_class(custom).supports_request_batch is False


@pytest.mark.parametrize(
    "name, modality",
    [("QwenImagePipeline", "image"), ("WanImageToVideoPipeline", "video"), ("StableDiffusionXLPipeline", "image"),
     ("HunyuanVideoPipeline", "video"), ("LTXPipeline", "video"), ("StableAudioPipeline", "audio")],
)
def test_output_modality(name, modality):
    assert registry.output_modality(name) == modality
