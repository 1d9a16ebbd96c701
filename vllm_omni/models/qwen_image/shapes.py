"""Qwen-Image's output shapes and memory facts from its configs: the VAE downsamples by
2 ** len(temperal_downsample) and the transformer packs 2 x 2 latent patches, so height and width are multiples
of twice the VAE factor; the denoise loop precomputes every block's image and text adaLN rows for all steps."""

from pathlib import Path

from vllm_omni.catalog.shapes import ShapeRule, read_config


def shape_rule(model_dir: Path) -> ShapeRule:
    vae, transformer = read_config(model_dir, "vae"), read_config(model_dir, "transformer")
    factor = 2 ** len(vae["temperal_downsample"])
    multiple = factor * transformer["patch_size"]
    return ShapeRule(size_multiple=multiple, min_size=multiple, token_stride=multiple, vae_spatial=factor,
                     hidden_size=transformer["num_attention_heads"] * transformer["attention_head_dim"],
                     latent_channels=vae["z_dim"], vae_channels=vae["base_dim"] * vae["dim_mult"][0],
                     text_tokens=1024, step_table_width=12 * transformer["num_layers"], default_size=(1024, 1024))
