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
from vllm_omni.catalog.tiny_tokenizers import write_qwen3_text_encoder

_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.37.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def _build(out_dir: Path, *, distilled: bool, seed: int, text_dim: int, vocab_size: int, **dit: int) -> None:
    """klein: a 27-layer Qwen3; `dit` sizes the transformer (see `_write_dit_vae_scheduler`)."""
    from transformers import Qwen3ForCausalLM

    write_qwen3_text_encoder(
        out_dir,
        Qwen3ForCausalLM,
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=text_dim,
        num_layers=27,
        num_heads=1,
        max_shard_size="300KB",
    )
    _write_dit_vae_scheduler(out_dir, seed=seed, text_dim=text_dim, guidance_embeds=False, **dit)
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


def _write_dit_vae_scheduler(
    out_dir: Path,
    *,
    seed: int,
    text_dim: int,
    num_heads: int,
    num_layers: int,
    num_single_layers: int,
    guidance_embeds: bool,
) -> None:
    """transformer/, vae/ (with non-trivial latent batch-norm statistics) and scheduler/."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

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
        guidance_embeds=guidance_embeds,
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


# Mistral / Pixtral specials the processor's chat template and image tokens use.
_MISTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "<pad>",
]
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% for c in message['content'] %}{{ c['text'] }}"
    "{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% for c in message['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}[/INST]"
    "{% else %}{% for c in message['content'] %}{{ c['text'] }}{% endfor %}{{ eos_token }}{% endif %}{% endfor %}"
)


def _write_mistral_processor(out: Path, vocab_size: int):
    """tokenizer/ as FLUX.2-dev ships it: the PixtralProcessor's tokenizer, chat template and processor configs.
    Written part by part: `PixtralProcessor` itself cannot be built without torchvision."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vllm_omni.catalog.tiny_tokenizers import CORPUS

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_MISTRAL_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = _MISTRAL_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "PixtralProcessor",
                "image_token": "[IMG]",
                "image_break_token": "[IMG_BREAK]",
                "image_end_token": "[IMG_END]",
                "patch_size": 16,
                "spatial_merge_size": 2,
            },
            indent=2,
        )
    )
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "PixtralImageProcessor",
                "processor_class": "PixtralProcessor",
                "patch_size": 16,
                "size": {"longest_edge": 64},
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "rescale_factor": 1 / 255,
            },
            indent=2,
        )
    )
    return tokenizer


def _build_dev(out_dir: Path, *, seed: int, text_dim: int, vocab_size: int, **dit: int) -> None:
    """[dev]: a 30-layer Mistral-3 with a Pixtral tower; `dit` sizes the transformer."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = _write_mistral_processor(out_dir / "tokenizer", vocab_size)
    torch.manual_seed(seed)
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config={
                "model_type": "mistral",
                "vocab_size": len(tokenizer),
                "hidden_size": text_dim,
                "intermediate_size": 2 * text_dim,
                "num_hidden_layers": 30,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "max_position_embeddings": 2048,
            },
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "head_dim": 32,
                "patch_size": 16,
                "image_size": 64,
            },
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        )
    ).eval()
    text_encoder.save_pretrained(out_dir / "text_encoder", safe_serialization=True, max_shard_size="300KB")
    _write_dit_vae_scheduler(out_dir, seed=seed, text_dim=text_dim, guidance_embeds=True, **dit)
    (out_dir / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "Flux2Pipeline",
                "_diffusers_version": "0.36.0.dev0",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
                "tokenizer": ["transformers", "PixtralProcessor"],
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


@tiny_checkpoint(
    "black-forest-labs/FLUX.2-dev layout: tiny 30-layer Mistral-3 (+ Pixtral) encoder, guidance-embedded "
    "FLUX.2 MMDiT, tiny VAE",
    **_DEFAULTS,
)
def build_flux2_dev(out_dir: Path, **params) -> None:
    _build_dev(out_dir, **params)


@tiny_checkpoint("black-forest-labs/FLUX.2-klein-base-4B layout (undistilled: CFG, 50 steps)", **_DEFAULTS)
def build_flux2_klein_base(out_dir: Path, **params) -> None:
    _build(out_dir, distilled=False, **params)
