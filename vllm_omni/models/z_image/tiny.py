"""Tiny Z-Image-Turbo checkpoint in the layout of `Tongyi-MAI/Z-Image-Turbo`.

The real repo: model_index.json, scheduler/ (static shift 3.0), text_encoder/ (transformers `Qwen3Model`, sharded
with an index), tokenizer/ (Qwen3's byte-level BPE with its chat template), transformer/ (diffusers
`ZImageTransformer2DModel`, sharded with an index), vae/ (the FLUX `AutoencoderKL`, one file). Components are the
reference classes built from tiny configs with seeded random weights and written by their own `save_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import write_qwen3_text_encoder

# scheduler/scheduler_config.json of the real repo.
_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.36.0.dev0",
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": False,
    "shift": 3.0,
}


def _build(
    out_dir: Path,
    *,
    seed: int,
    text_dim: int,
    dim: int,
    num_heads: int,
    num_layers: int,
    num_refiner_layers: int,
    vocab_size: int,
) -> None:
    import torch
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    write_qwen3_text_encoder(
        out_dir,
        Qwen3Model,
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=text_dim,
        num_layers=3,
        num_heads=2,
        max_shard_size="200KB",
    )
    torch.manual_seed(seed + 1)
    head_dim = dim // num_heads
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=dim,
        n_layers=num_layers,
        n_refiner_layers=num_refiner_layers,
        n_heads=num_heads,
        n_kv_heads=num_heads,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=text_dim,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8],
        axes_lens=[1536, 512, 512],
    )
    # diffusers initialises the pad tokens to zeros; random ones make the parity tests see where they go.
    with torch.no_grad():
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True, max_shard_size="300KB")
    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(8, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae.save_pretrained(out_dir / "vae", safe_serialization=True)
    (out_dir / "scheduler").mkdir()
    (out_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))
    (out_dir / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "ZImagePipeline",
                "_diffusers_version": "0.36.0.dev0",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen3Model"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"],
                "transformer": ["diffusers", "ZImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
            },
            indent=2,
        )
    )


@tiny_checkpoint(
    "Tongyi-MAI/Z-Image-Turbo layout: tiny Qwen3 encoder, 2+2+2-layer single-stream DiT, tiny VAE",
    seed=0,
    text_dim=64,
    dim=64,
    num_heads=2,
    num_layers=2,
    num_refiner_layers=2,
    vocab_size=512,
)
def build_z_image_turbo(out_dir: Path, **params) -> None:
    _build(out_dir, **params)
