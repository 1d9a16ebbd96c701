"""Write a real-size Qwen-Image or FLUX.1-dev checkpoint directory WITHOUT weights, for `load_format="dummy"`.

The real Hugging Face repo layout (model_index.json, transformer/, text_encoder(_2)/, vae/, scheduler/,
tokenizer(_2)/) with the published component sizes, and no weight file: the GPU machine has neither internet nor
checkpoints, and `vllm serve DIR --omni --load-format dummy` / `Omni(DIR, load_format="dummy")` build every
component from these configs with random weights, so timings and memory are those of the real model.

The layout, the scheduler config and the tokenizers come from our tiny checkpoint of the same family (its token
ids are far below the real vocab sizes, and its special-token ids are kept in the configs); only the sizes change.
`--tiny` keeps the tiny sizes (CPU smoke tests).

  python3 benchmarks/diffusion/write_config_only_checkpoint.py --model qwen-image --out /tmp/qi
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit_forward import FLUX_CONFIG, QWEN_CONFIG  # noqa: E402

# Real component sizes that are not the transformer's (the same values bench_pipeline.py builds its real-size
# text encoders and VAEs from; there they live inside functions, so they are spelled out here).
QWEN_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                 max_window_layers=28)
QWEN_MROPE_SECTION = [16, 24, 24]
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   fullatt_block_indexes=[7, 15, 23, 31], window_size=112, tokens_per_second=2)
QWEN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True])
CLIP_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                 num_hidden_layers=12, projection_dim=768, hidden_act="quick_gelu", max_position_embeddings=77)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24,
              num_heads=64, relative_attention_num_buckets=32, feed_forward_proj="gated-gelu",
              dense_act_fn="gelu_new", is_gated_act=True)
FLUX_VAE = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16, norm_num_groups=32,
                sample_size=1024, use_quant_conv=False, use_post_quant_conv=False)


def _qwen_text_encoder(config: dict[str, Any]) -> None:
    text = config["text_config"]
    text.update(QWEN_TEXT)
    text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": QWEN_MROPE_SECTION}
    config["vision_config"].update(QWEN_VISION)


REAL_SIZES: dict[str, dict[str, Any]] = {
    # subfolder -> dict update, or a function editing the parsed config in place
    "qwen-image": {"transformer": QWEN_CONFIG, "text_encoder": _qwen_text_encoder, "vae": QWEN_VAE},
    "flux": {"transformer": FLUX_CONFIG, "text_encoder": CLIP_TEXT, "text_encoder_2": T5_XXL, "vae": FLUX_VAE},
}


def write_checkpoint(model: str, out: Path, tiny: bool = False) -> Path:
    """Copy the tiny checkpoint's layout minus weights to `out`, then (unless `tiny`) set the real sizes."""
    from vllm_omni.catalog.resolution import INDEX_FILES, WEIGHT_FILE_PATTERNS
    from vllm_omni.catalog.tiny import build_tiny

    if model not in REAL_SIZES:
        raise ValueError(f"--model must be one of {sorted(REAL_SIZES)}, got {model!r}")
    if out.exists():
        if any(out.iterdir()) and not (out / "model_index.json").is_file():
            raise FileExistsError(f"--out {out} exists and is not a checkpoint directory; not replacing it")
        shutil.rmtree(out)

    def weights(_: str, names: list[str]) -> list[str]:
        return [n for n in names if n in INDEX_FILES or n == ".complete"
                or any(fnmatch.fnmatch(n, p) for p in WEIGHT_FILE_PATTERNS)]

    shutil.copytree(build_tiny(model), out, ignore=weights)
    if tiny:
        return out
    for subfolder, change in REAL_SIZES[model].items():
        path = out / subfolder / "config.json"
        config = json.loads(path.read_text())
        if callable(change):
            change(config)
        else:
            config.update(change)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(REAL_SIZES))
    parser.add_argument("--out", type=Path, required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--tiny", action="store_true", help="keep the tiny sizes (CPU smoke tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = write_checkpoint(args.model, args.out, args.tiny)
    print(f"wrote {'tiny' if args.tiny else 'real-size'} config-only {args.model} checkpoint to {out}")
    return out


if __name__ == "__main__":
    main()
