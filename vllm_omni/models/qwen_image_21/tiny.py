"""Tiny Qwen-Image-2.1 checkpoint in the layout of `Qwen/Qwen-Image-2.1`.

The real repo: model_index.json (`QwenImage21Pipeline`), scheduler/ (FlowMatchEulerDiscreteScheduler, dynamic
shift), text_encoder/ (transformers `Qwen3VLForConditionalGeneration`), processor/ (`Qwen3VLProcessor`: tokenizer,
chat template, image and video preprocessor configs), transformer/ (diffusers `QwenImage21Transformer2DModel`),
vae/ (diffusers `AutoencoderKLQwenImage21`, 16x spatial, 64 latent channels). Components are the reference classes
built from tiny configs with seeded random weights and written by their own `save_pretrained`; the tokenizer is
Qwen-Image's tiny byte-level BPE with the Qwen-VL special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint

_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
}


def _text_encoder(tokenizer, hidden_size: int, seed: int):
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {
        tok: tokenizer.convert_tokens_to_ids(tok)
        for tok in (
            "<|endoftext|>",
            "<|im_end|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<|vision_start|>",
            "<|vision_end|>",
        )
    }
    head_dim = 16
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    # transformers' init can leave parameters as allocated memory; draw every weight.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.05)
    return model


def _write_processor(out: Path, tokenizer) -> None:
    """processor/ part by part: `Qwen3VLProcessor` itself cannot be built without torchvision (its video half)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sizes = {
        "min_pixels": 32 * 32,
        "max_pixels": 1536 * 1536,  # a condition image (about 1024^2) is not resized: its slots match its latents
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    image_processor = Qwen2VLImageProcessorPil(**sizes, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor.save_pretrained(out)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen3VLProcessor")
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    video = {
        **sizes,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "image_mean": config["image_mean"],
        "image_std": config["image_std"],
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.save_pretrained(out)


def _build(
    out_dir: Path, *, seed: int, text_dim: int, num_heads: int, head_dim: int, num_layers: int, latent_channels: int
) -> None:
    import torch
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    from vllm_omni.models.qwen_image.tiny import _make_tokenizer

    tokenizer = _make_tokenizer()
    _text_encoder(tokenizer, text_dim, seed).save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    _write_processor(out_dir / "processor", tokenizer)
    torch.manual_seed(seed + 1)
    transformer = QwenImage21Transformer2DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        context_in_dim=text_dim,
        mlp_ratio=3,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )
    # diffusers zero-initialises the norm weights and several projections; random ones let parity see them.
    with torch.no_grad():
        for param in transformer.parameters():
            param.normal_(0.0, 0.3 if param.dim() == 1 else 0.08)
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True)
    torch.manual_seed(seed + 2)
    generator = torch.Generator().manual_seed(seed + 3)
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=torch.randn(latent_channels, generator=generator).mul(0.5).tolist(),
        latents_std=torch.rand(latent_channels, generator=generator).add(0.5).tolist(),
    )
    vae.save_pretrained(out_dir / "vae", safe_serialization=True)
    (out_dir / "scheduler").mkdir()
    (out_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))
    (out_dir / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "QwenImage21Pipeline",
                "_diffusers_version": "0.42.1",
                "processor": ["transformers", "Qwen3VLProcessor"],
                "sample_sigmas": None,
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
                "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
                "vae": ["diffusers", "AutoencoderKLQwenImage21"],
            },
            indent=2,
        )
    )


@tiny_checkpoint(
    "Qwen/Qwen-Image-2.1 layout: tiny Qwen3-VL encoder and processor, 2-layer block-causal DiT, tiny VAE",
    seed=0,
    text_dim=64,
    num_heads=2,
    head_dim=32,
    num_layers=2,
    latent_channels=16,
)
def build_qwen_image_21(out_dir: Path, **params) -> None:
    _build(out_dir, **params)
