"""Tiny FLUX.1-dev checkpoint in the layout of `black-forest-labs/FLUX.1-dev`.

Components are the reference classes (diffusers / transformers) built from tiny configs with seeded random
weights and written by diffusers' `FluxPipeline.save_pretrained`: model_index.json, scheduler/, text_encoder/
(CLIP), text_encoder_2/ (T5, sharded with an index), tokenizer/ (CLIP BPE), tokenizer_2/ (T5 unigram),
transformer/ (sharded with an index), vae/. Both tokenizers are made locally with `tokenizers`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import CORPUS

# scheduler/scheduler_config.json of the real repo.
_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.30.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def _clip_tokenizer():
    """CLIP-style BPE: lower-cased, byte-level alphabet, `</w>` word suffix, start/end-of-text specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, end_of_word_suffix="</w>",
                                  show_progress=False)
    bpe.train_from_iterator([line.lower() for line in CORPUS] * 4, trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for ch in sorted(alphabet):
        vocab[ch + "</w>"] = len(vocab)
    for token in state["vocab"]:
        vocab.setdefault(token, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges)
    tokenizer.model_max_length = 77
    return tokenizer


def _t5_tokenizer():
    """T5-style unigram over whole words and single characters (`▁` word boundary), 100 sentinel ids."""
    from transformers import T5Tokenizer

    words = sorted({w for line in CORPUS for w in line.split()})
    chars = sorted({c for line in CORPUS for c in line})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -5.0 - len(w) / 10) for w in words] + [(c, -10.0) for c in chars]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=100)
    tokenizer.model_max_length = 512
    return tokenizer


def _build(out_dir: Path, *, seed: int, dim_heads: int, num_heads: int, num_layers: int, num_single_layers: int,
           text_dim: int, clip_dim: int) -> None:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=clip_dim, intermediate_size=2 * clip_dim, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=clip_dim, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=text_dim, d_kv=16, d_ff=2 * text_dim, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dense_act_fn="gelu_new",
        is_gated_act=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )).eval()
    torch.manual_seed(seed + 2)
    head_dim = dim_heads
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=text_dim,
        pooled_projection_dim=clip_dim, guidance_embeds=True, axes_dims_rope=(head_dim // 4, 3 * head_dim // 8,
                                                                              3 * head_dim // 8),
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in _SCHEDULER_CONFIG.items() if k[0] != "_"})
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    # The real repo shards text_encoder_2 and transformer (several files + an index); so do we.
    pipe.save_pretrained(out_dir, safe_serialization=True, max_shard_size="60KB")
    for name, module in (("vae", vae), ("text_encoder", text_encoder)):  # one file each in the real repo
        shutil.rmtree(out_dir / name)
        module.save_pretrained(out_dir / name, safe_serialization=True)
    (out_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))


@tiny_checkpoint("black-forest-labs/FLUX.1-dev layout: tiny CLIP + T5 encoders, 2+2-block MMDiT, tiny VAE",
               seed=0, dim_heads=32, num_heads=2, num_layers=2, num_single_layers=2, text_dim=32, clip_dim=32)
def build_flux(out_dir: Path, **params) -> None:
    _build(out_dir, **params)
