"""FLUX's output shapes from its configs: like diffusers, the pipeline rounds height and width down to the
2 x 2-patch latent grid (VAE factor 2 ** (len(block_out_channels) - 1)), so any size of one patch or more works."""

from pathlib import Path

from vllm_omni.models.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    patch = 2 ** (len(read_config(model_dir, "vae")["block_out_channels"]) - 1) * 2
    return ShapeRule(size_multiple=1, min_size=patch)
