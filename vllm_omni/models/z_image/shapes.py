"""Z-Image's output shapes and memory facts from its configs: height and width must be multiples of the VAE
factor x the 2 x 2 patch (diffusers refuses others); text and image tokens are padded to multiples of 32."""

from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return ShapeRule(
        size_multiple=factor * 2,
        min_size=factor * 2,
        token_stride=factor * 2,
        vae_spatial=factor,
        hidden_size=transformer["dim"],
        latent_channels=vae["latent_channels"],
        vae_channels=vae["block_out_channels"][0],
        text_tokens=512,
        default_size=(1024, 1024),
        default_steps=9,
    )
