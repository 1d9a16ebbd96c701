"""Wan's output shapes and memory facts from its configs: height and width are multiples of the VAE's spatial
factor times the transformer's spatial patch (16 for Wan2.1, 32 for Wan2.2-TI2V-5B); frames come as
1 + k * temporal factor."""

from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    multiple = vae["scale_factor_spatial"] * transformer["patch_size"][1]
    return ShapeRule(size_multiple=multiple, min_size=multiple, frame_stride=vae["scale_factor_temporal"],
                     token_stride=multiple, vae_spatial=vae["scale_factor_spatial"],
                     hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
                     latent_channels=vae["z_dim"],
                     vae_channels=(vae.get("decoder_base_dim") or vae["base_dim"]) * vae["dim_mult"][0],
                     text_tokens=512, default_size=(480, 832), default_frames=81)
