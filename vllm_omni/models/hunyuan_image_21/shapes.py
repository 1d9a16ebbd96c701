"""HunyuanImage-2.1's output shapes and memory facts from its configs: height and width must be multiples of the
VAE factor x the patch (32 for the real model); 2048 x 2048 by default (diffusers' 64 latents a side); the
distilled checkpoint (guidance-embedded) runs 8 steps by default, the other 50."""

from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    factor = vae["spatial_compression_ratio"]
    stride = factor * transformer.get("patch_size", [1, 1])[0]
    side = 64 * factor
    return ShapeRule(
        size_multiple=stride,
        min_size=stride,
        token_stride=stride,
        vae_spatial=factor,
        hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
        latent_channels=vae["latent_channels"],
        vae_channels=vae["block_out_channels"][0],
        text_tokens=1000 + 128,
        default_size=(side, side),
        default_steps=8 if transformer.get("guidance_embeds") else 50,
    )
