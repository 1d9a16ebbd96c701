"""Tiny FLUX.2 [klein] checkpoints in the layout of `black-forest-labs/FLUX.2-klein-4B` (and the -base repo).

The real repos: model_index.json (with `is_distilled`), scheduler/, text_encoder/ (transformers
`Qwen3ForCausalLM`, sharded with an index), tokenizer/ (Qwen3's byte-level BPE and chat template), transformer/
(diffusers `Flux2Transformer2DModel`), vae/ (`AutoencoderKLFlux2` with its latent batch norm). The tiny Qwen3 has
27 layers because the pipeline reads hidden states 9, 18 and 27.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import QWEN3_CHAT_TEMPLATE, build_qwen_bpe, save_qwen_tokenizer

_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.37.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def _build(
    out_dir: Path,
    *,
    distilled: bool,
    seed: int,
    text_dim: int,
    num_heads: int,
    num_layers: int,
    num_single_layers: int,
    vocab_size: int,
) -> None:
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import AutoConfig, Qwen3ForCausalLM

    save_qwen_tokenizer(out_dir / "tokenizer", build_qwen_bpe(vocab_size), chat_template=QWEN3_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(
        AutoConfig.for_model(
            "qwen3",
            vocab_size=vocab_size,
            hidden_size=text_dim,
            intermediate_size=2 * text_dim,
            num_hidden_layers=27,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=2048,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        )
    ).eval()
    text_encoder.save_pretrained(out_dir / "text_encoder", safe_serialization=True, max_shard_size="300KB")
    torch.manual_seed(seed + 1)
    head_dim = 32
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=32,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=3 * text_dim,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=False,
    )
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True, max_shard_size="300KB")
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
    )
    with torch.no_grad():  # trained statistics, not the identity a fresh batch norm holds
        vae.bn.running_mean.normal_(0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    vae.save_pretrained(out_dir / "vae", safe_serialization=True)
    (out_dir / "scheduler").mkdir()
    (out_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))
    (out_dir / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "Flux2KleinPipeline",
                "_diffusers_version": "0.37.0.dev0",
                "is_distilled": distilled,
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen3ForCausalLM"],
                "tokenizer": ["transformers", "Qwen2TokenizerFast"],
                "transformer": ["diffusers", "Flux2Transformer2DModel"],
                "vae": ["diffusers", "AutoencoderKLFlux2"],
            },
            indent=2,
        )
    )


_DEFAULTS = dict(seed=0, text_dim=32, num_heads=2, num_layers=2, num_single_layers=2, vocab_size=512)


@tiny_checkpoint(
    "black-forest-labs/FLUX.2-klein-4B layout: tiny 27-layer Qwen3, 2+2-block FLUX.2 MMDiT, tiny VAE", **_DEFAULTS
)
def build_flux2_klein(out_dir: Path, **params) -> None:
    _build(out_dir, distilled=True, **params)


@tiny_checkpoint("black-forest-labs/FLUX.2-klein-base-4B layout (undistilled: CFG, 50 steps)", **_DEFAULTS)
def build_flux2_klein_base(out_dir: Path, **params) -> None:
    _build(out_dir, distilled=False, **params)
