"""Wan's output shapes from its configs: height and width are multiples of the VAE's spatial factor times the
transformer's spatial patch (16 for Wan2.1, 32 for Wan2.2-TI2V-5B); frames come as 1 + k * temporal factor."""

from pathlib import Path

from vllm_omni.models.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae = read_config(model_dir, "vae")
    multiple = vae["scale_factor_spatial"] * read_config(model_dir, "transformer")["patch_size"][1]
    return ShapeRule(size_multiple=multiple, min_size=multiple, frame_stride=vae["scale_factor_temporal"])
