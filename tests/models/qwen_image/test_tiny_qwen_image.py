"""Pins the on-disk layout of the tiny Qwen-Image checkpoints: what the real Qwen/Qwen-Image(-Edit) repos ship."""

from __future__ import annotations

import json


def test_qwen_image_layout(qwen_image_dir):
    index = json.loads((qwen_image_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLQwenImage"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    for sub, name in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model")):
        weight_map = json.loads((qwen_image_dir / sub / f"{name}.safetensors.index.json").read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        assert len(shards) > 1 and all((qwen_image_dir / sub / s).is_file() for s in shards)
        assert shards[0].startswith(f"{name}-00001-of-")
    assert (qwen_image_dir / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    scheduler = json.loads((qwen_image_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and scheduler["time_shift_type"] == "exponential"


def test_tokenizer_has_template_special_tokens(qwen_image_edit_dir):
    from transformers import AutoTokenizer

    index = json.loads((qwen_image_edit_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert (qwen_image_edit_dir / "processor" / "preprocessor_config.json").is_file()
    for sub in ("tokenizer", "processor"):
        tokenizer = AutoTokenizer.from_pretrained(qwen_image_edit_dir / sub)
        for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
            ids = tokenizer(token, add_special_tokens=False).input_ids
            assert ids == [tokenizer.convert_tokens_to_ids(token)], token
