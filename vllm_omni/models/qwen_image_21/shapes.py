"""Qwen-Image-2.1's output shapes and memory facts from its configs: height and width are multiples of 32 (the
16x VAE x the 2 x 2 token groups the text encoder reserves slots for; diffusers rounds others down)."""

from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    return ShapeRule(
        size_multiple=32,
        min_size=32,
        token_stride=16,
        vae_spatial=16,
        hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
        latent_channels=vae["z_dim"],
        vae_channels=vae.get("decoder_base_dim") or vae["base_dim"],
        text_tokens=1024,
        default_size=(1024, 1024),
        default_steps=40,
    )
