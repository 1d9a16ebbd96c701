"""FLUX.2 klein's output shapes and memory facts from its configs: like diffusers, the pipeline rounds height and
width down to the 2 x 2-patch latent grid, so any size of one patch or more works; steps default by
`is_distilled` in model_index.json."""

import json
from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    distilled = json.loads((Path(model_dir) / "model_index.json").read_text()).get("is_distilled", False)
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return ShapeRule(
        size_multiple=1,
        min_size=factor * 2,
        token_stride=factor * 2,
        vae_spatial=factor,
        hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
        latent_channels=vae["latent_channels"],
        vae_channels=vae["block_out_channels"][0],
        text_tokens=512,
        default_size=(1024, 1024),
        default_steps=4 if distilled else 50,
    )
