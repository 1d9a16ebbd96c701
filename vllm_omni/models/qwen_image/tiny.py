"""Tiny Qwen-Image / Qwen-Image-Edit checkpoints in the layout of `Qwen/Qwen-Image` and `Qwen/Qwen-Image-Edit`.

Components are built with the reference classes (diffusers / transformers) from tiny configs with seeded random
weights and written with their own `save_pretrained`, so the files, names and shard indexes are what the real
repos ship. The tokenizer is a byte-level BPE made locally with the Qwen2.5-VL special tokens the prompt
templates use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint

# Special tokens of Qwen2.5-VL, in the order of the real vocabulary (ids follow the byte-level base vocab).
_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
_MERGE_CORPUS = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
    "of the objects and background. Describe the key features of the input image, then explain how the "
    "user's text instruction should alter or modify the image. a cat holding a sign that says hello world"
)
_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.34.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _make_tokenizer():
    """Byte-level BPE with a few merges learned from the prompt templates, plus the Qwen2.5-VL specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([_MERGE_CORPUS] * 4, trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL_TOKENS[1:])})
    tokenizer.model_max_length = 131072
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _text_encoder_config(tokenizer, hidden_size: int):
    from transformers import Qwen2_5_VLConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in _SPECIAL_TOKENS}
    head_dim = 32
    num_heads = hidden_size // head_dim
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": num_heads,
            "num_key_value_heads": max(1, num_heads // 2),
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 1,
            "out_hidden_size": hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


def _write_processor(out: Path, tokenizer, max_pixels: int) -> None:
    """processor/ as the real Edit repo ships it (image + video preprocessor configs, tokenizer, template).

    Written part by part: `Qwen2VLProcessor` itself cannot be built without torchvision (its video processor).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sizes = {"min_pixels": 28 * 28, "max_pixels": max_pixels, "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2}
    image_processor = Qwen2VLImageProcessorPil(**sizes)
    image_processor.save_pretrained(out)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    video = {**sizes, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor",
             "image_mean": config["image_mean"], "image_std": config["image_std"], "do_resize": True,
             "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.save_pretrained(out)


def _build(out_dir: Path, *, edit: bool, seed: int, hidden_size: int, num_layers: int, num_heads: int,
           vae_base_dim: int, max_pixels: int) -> None:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = _make_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer, hidden_size)).eval()
    torch.manual_seed(seed + 1)
    head_dim = 32
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=hidden_size,
        axes_dims_rope=(8, 12, 12),
    )
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(base_dim=vae_base_dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 attn_scales=[], temperal_downsample=[False, True, True])
    config = {k: v for k, v in _SCHEDULER_CONFIG.items() if not k.startswith("_")}
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    components = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer)
    # Shard like the real repos: text encoder and transformer in several files + index, VAE in one file.
    pipe_cls = QwenImageEditPipeline if edit else QwenImagePipeline
    pipe = pipe_cls(**components, **({"processor": None} if edit else {}))
    pipe.save_pretrained(out_dir, safe_serialization=True, max_shard_size="300KB")
    shutil.rmtree(out_dir / "vae")
    vae.save_pretrained(out_dir / "vae", safe_serialization=True)
    if edit:
        _write_processor(out_dir / "processor", tokenizer, max_pixels)
    (out_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))
    index = json.loads((out_dir / "model_index.json").read_text())
    index["_diffusers_version"] = _SCHEDULER_CONFIG["_diffusers_version"]
    if edit:
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))


_DEFAULTS = dict(seed=0, hidden_size=64, num_layers=2, num_heads=2, vae_base_dim=4, max_pixels=112 * 112)


@tiny_checkpoint("Qwen/Qwen-Image layout: tiny Qwen2.5-VL encoder, 2-layer MMDiT, tiny VAE", **_DEFAULTS)
def build_qwen_image(out_dir: Path, **params) -> None:
    _build(out_dir, edit=False, **params)


@tiny_checkpoint("Qwen/Qwen-Image-Edit layout: tiny Qwen2.5-VL (+vision) encoder and processor",
               **_DEFAULTS)
def build_qwen_image_edit(out_dir: Path, **params) -> None:
    _build(out_dir, edit=True, **params)
