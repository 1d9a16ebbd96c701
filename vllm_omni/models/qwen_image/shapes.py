"""Qwen-Image's output shapes from its configs: the VAE downsamples by 2 ** len(temperal_downsample) and the
transformer packs 2 x 2 latent patches, so height and width are multiples of twice the VAE factor."""

from pathlib import Path

from vllm_omni.models.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    multiple = 2 ** len(read_config(model_dir, "vae")["temperal_downsample"]) * 2
    return ShapeRule(size_multiple=multiple, min_size=multiple)
