"""LTX-2's output shapes and memory facts from its configs: height and width are multiples of the video VAE's
spatial factor times the transformer's patch, and never of less than 32 (diffusers checks 32 for every LTX-2
VAE); the two-stage variant's base pass makes half the size, so there they are multiples of twice that. Frames
come as 1 + k * the VAE's temporal factor."""

from pathlib import Path
from typing import Any

from vllm_omni.catalog.shapes import ShapeRule, read_config

DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES = 512, 768, 121
DEFAULT_NUM_INFERENCE_STEPS = 40
SIZE_MULTIPLE = 32
"""Height and width are multiples of 32 (the real VAE's spatial factor; diffusers checks it for every VAE)."""


def _vae_factor(vae: dict[str, Any], ratio: str, patch: str) -> int:
    """What diffusers' `AutoencoderKLLTX2Video` computes when the config leaves the ratio unset."""
    if vae.get(ratio):
        return vae[ratio]
    scaling = vae["spatio_temporal_scaling"]
    doublings = sum(scaling) if isinstance(scaling, list) else scaling * (len(vae["layers_per_block"]) - 1)
    return vae[patch] * 2**doublings


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    spatial = _vae_factor(vae, "spatial_compression_ratio", "patch_size")
    multiple = max(SIZE_MULTIPLE, spatial * transformer["patch_size"])
    return ShapeRule(
        size_multiple=multiple,
        min_size=multiple,
        half_size_knob="two_stage",
        frame_stride=_vae_factor(vae, "temporal_compression_ratio", "patch_size_t"),
        token_stride=spatial * transformer["patch_size"],
        vae_spatial=spatial,
        hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
        latent_channels=vae["latent_channels"],
        vae_channels=vae["decoder_block_out_channels"][0],
        text_tokens=1024,
        default_size=(DEFAULT_HEIGHT, DEFAULT_WIDTH),
        default_frames=DEFAULT_NUM_FRAMES,
        default_steps=DEFAULT_NUM_INFERENCE_STEPS,
    )
