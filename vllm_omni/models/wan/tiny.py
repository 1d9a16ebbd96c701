"""Tiny Wan 2.1 / 2.2 video checkpoints in the layout of the Wan-AI/*-Diffusers repos.

Real repos: model_index.json, scheduler/scheduler_config.json (UniPC with flow sigmas + flow_shift),
text_encoder/ (UMT5EncoderModel, sharded + index), tokenizer/ (umt5 T5 tokenizer), transformer/ (and
transformer_2/ for Wan2.2 A14B; WanTransformer3DModel, sharded + index), vae/ (AutoencoderKLWan) and, for
I2V, image_encoder/ (CLIPVisionModel) + image_processor/ (CLIPImageProcessor). Everything here is the
same files with tiny random weights, so diffusers' WanPipeline / WanImageToVideoPipeline load them offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_omni.catalog.tiny import tiny_checkpoint

_CORPUS = [
    "A cat walks on the grass, camera slowly pans left.",
    "A red car drives along a coastal road at sunset, cinematic lighting.",
    "Two astronauts float inside a space station, soft blue light.",
    "Ocean waves crash against the rocks in slow motion.",
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality.",
    "A dog runs through a field of flowers on a sunny morning.",
    "1 2 3 4 5 6 7 8 9 10 one two three four five six seven eight nine ten",
]
_T5_SPECIALS = ["<pad>", "</s>", "<unk>"]

# Per-channel latent statistics of the Wan 2.1 VAE (z_dim 16), as in the real vae/config.json.
_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_t5_tokenizer(out: Path, vocab_size: int) -> None:
    """A SentencePiece-style Unigram tokenizer like umt5's (pad=0, eos=1, unk=2, Metaspace, `$A </s>`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=_T5_SPECIALS, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", eos)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "special_tokens_map.json", {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "T5Tokenizer",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "extra_ids": 0,
        "additional_special_tokens": [],
        "model_max_length": 1000000000000000019884624838656,
        "clean_up_tokenization_spaces": True,
    })


def _write_text_encoder(out: Path, *, vocab_size: int, d_model: int, seed: int) -> None:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=2,
                        num_heads=2, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0, dtype="bfloat16")
    torch.manual_seed(seed)
    model = UMT5EncoderModel(config)
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(out, max_shard_size=total // 2 + 1)


def _write_transformer(out: Path, *, seed: int, in_channels: int, text_dim: int, image_dim: int | None,
                       num_heads: int, head_dim: int, num_layers: int, out_channels: int = 16) -> None:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    inner = num_heads * head_dim
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=in_channels,
        out_channels=out_channels, text_dim=text_dim, freq_dim=32, ffn_dim=2 * inner, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=image_dim,
        added_kv_proj_dim=inner if image_dim is not None else None, rope_max_seq_len=1024,
    )
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(out, max_shard_size=total // 2 + 1, safe_serialization=True)


def _write_vae(out: Path, *, seed: int, base_dim: int, wan22: bool = False) -> None:
    """Wan 2.1 VAE (z 16, 8x spatial); `wan22`: the Wan2.2 TI2V VAE (z 48, residual blocks, 2x2 patchify, 16x)."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    extra: dict[str, Any] = dict(latents_mean=_LATENTS_MEAN, latents_std=_LATENTS_STD)
    if wan22:  # per-channel stats of the tiny model: fixed stand-ins (the real ones belong to the real weights)
        extra = dict(z_dim=48, decoder_base_dim=base_dim, is_residual=True, in_channels=12, out_channels=12,
                     patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                     latents_mean=[round(0.05 * ((i % 7) - 3), 3) for i in range(48)],
                     latents_std=[round(0.8 + 0.05 * (i % 9), 3) for i in range(48)])
    vae = AutoencoderKLWan(base_dim=base_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[False, True, True], dropout=0.0, **{"z_dim": 16, **extra})
    vae.save_pretrained(out, safe_serialization=True)


def _write_image_encoder(out: Path, *, seed: int, hidden_size: int, image_size: int) -> None:
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                              num_attention_heads=2, image_size=image_size, patch_size=14, projection_dim=hidden_size,
                              hidden_act="gelu", dtype="float32")
    torch.manual_seed(seed)
    CLIPVisionModel(config).save_pretrained(out / "image_encoder")
    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        do_resize=True, do_center_crop=True, do_normalize=True, do_rescale=True, do_convert_rgb=True, resample=3,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    ).save_pretrained(out / "image_processor")


def _write_scheduler(out: Path, flow_shift: float) -> None:
    _write_json(out / "scheduler" / "scheduler_config.json", {
        "_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.33.0.dev0",
        "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": flow_shift,
        "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True,
        "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False, "sample_max_value": 1.0,
        "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0, "thresholding": False,
        "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
        "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False,
    })


def _write_wan(out: Path, *, variant: str, vocab_size: int, text_dim: int, num_heads: int, head_dim: int,
               num_layers: int, vae_base_dim: int, clip_hidden: int, clip_image_size: int, flow_shift: float,
               boundary_ratio: float | None, seed: int, with_clip: bool = True) -> None:
    i2v = variant == "i2v"
    ti2v = variant == "ti2v"
    with_clip = i2v and with_clip
    index: dict[str, Any] = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "_diffusers_version": "0.33.0.dev0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if with_clip:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
        _write_image_encoder(out, seed=seed + 4, hidden_size=clip_hidden, image_size=clip_image_size)
    elif i2v:  # Wan2.2 I2V A14B ships without a CLIP image encoder
        index["image_encoder"] = [None, None]
        index["image_processor"] = [None, None]
    if boundary_ratio is not None:
        index.update(boundary_ratio=boundary_ratio, expand_timesteps=False,
                     transformer_2=["diffusers", "WanTransformer3DModel"])
    if ti2v:
        index.update(boundary_ratio=None, expand_timesteps=True)
    _write_json(out / "model_index.json", index)
    _write_scheduler(out, flow_shift)
    _write_t5_tokenizer(out / "tokenizer", vocab_size)
    _write_text_encoder(out / "text_encoder", vocab_size=vocab_size, d_model=text_dim, seed=seed)
    dit = dict(in_channels=48 if ti2v else 36 if i2v else 16, out_channels=48 if ti2v else 16, text_dim=text_dim,
               image_dim=clip_hidden if with_clip else None, num_heads=num_heads, head_dim=head_dim,
               num_layers=num_layers)
    _write_transformer(out / "transformer", seed=seed + 1, **dit)
    if boundary_ratio is not None:
        _write_transformer(out / "transformer_2", seed=seed + 2, **dit)
    _write_vae(out / "vae", seed=seed + 3, base_dim=vae_base_dim, wan22=ti2v)


_COMMON = dict(vocab_size=256, text_dim=32, num_heads=2, head_dim=32, num_layers=2, vae_base_dim=8,
               clip_hidden=32, clip_image_size=56, seed=0)


@tiny_checkpoint("Wan2.1 T2V (layout of Wan-AI/Wan2.1-T2V-1.3B-Diffusers), 2-layer DiT, hidden 64",
               variant="t2v", flow_shift=3.0, boundary_ratio=None, **_COMMON)
def build_wan21_t2v(out: Path, **params: Any) -> None:
    _write_wan(out, **params)


@tiny_checkpoint("Wan2.1 I2V (layout of Wan-AI/Wan2.1-I2V-14B-480P-Diffusers) with a tiny CLIP vision",
               variant="i2v", flow_shift=3.0, boundary_ratio=None, **_COMMON)
def build_wan21_i2v(out: Path, **params: Any) -> None:
    _write_wan(out, **params)


@tiny_checkpoint("Wan2.2 T2V A14B (layout of Wan-AI/Wan2.2-T2V-A14B-Diffusers): two experts",
               variant="t2v", flow_shift=12.0, boundary_ratio=0.875, **_COMMON)
def build_wan22_t2v_a14b(out: Path, **params: Any) -> None:
    _write_wan(out, **params)


@tiny_checkpoint("Wan2.2 I2V A14B (layout of Wan-AI/Wan2.2-I2V-A14B-Diffusers): two experts, no CLIP",
               variant="i2v", flow_shift=5.0, boundary_ratio=0.9, with_clip=False, **_COMMON)
def build_wan22_i2v_a14b(out: Path, **params: Any) -> None:
    _write_wan(out, **params)


@tiny_checkpoint("Wan2.2 TI2V 5B (layout of Wan-AI/Wan2.2-TI2V-5B-Diffusers): per-token timesteps, "
               "48-channel VAE with 16x spatial compression", variant="ti2v", flow_shift=5.0, boundary_ratio=None,
               **{**_COMMON, "vae_base_dim": 16})
def build_wan22_ti2v_5b(out: Path, **params: Any) -> None:
    _write_wan(out, **params)
