"""Tiny HunyuanImage-2.1 checkpoints in the Diffusers layout of `tencent/HunyuanImage-2.1`
(`hunyuanvideo-community/HunyuanImage-2.1-Diffusers` and its `-Distilled-` sibling).

The real repos: model_index.json, scheduler/ (FlowMatchEulerDiscreteScheduler), text_encoder/ (transformers
`Qwen2_5_VLForConditionalGeneration`, sharded with an index), tokenizer/ (Qwen2.5-VL's), text_encoder_2/ (a ByT5
`T5EncoderModel`), tokenizer_2/ (`ByT5Tokenizer`), transformer/ (diffusers `HunyuanImageTransformer2DModel`,
sharded), vae/ (`AutoencoderKLHunyuanImage`), and, for the undistilled model, guider/ and ocr_guider/
(`AdaptiveProjectedMixGuidance`). Components are the reference classes built from tiny configs with seeded random
weights and written by diffusers' own `save_pretrained` of the pipeline. The tiny guiders start adaptive projected
guidance after step 1 instead of the real 5 so that few-step tests run both phases (the OCR guider differs by
its CFG scale).
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint

_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 5.0, "use_dynamic_shifting": False}


def _build(out_dir: Path, *, distilled: bool, seed: int, text_dim: int, glyph_dim: int, num_heads: int,
           head_dim: int, num_layers: int, num_single_layers: int) -> None:
    import torch
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLForConditionalGeneration, T5Config, T5EncoderModel

    from vllm_omni.models.qwen_image.tiny import _make_tokenizer, _text_encoder_config

    tokenizer = _make_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer, text_dim)).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=glyph_dim, d_kv=8, d_ff=2 * glyph_dim,
                                             num_layers=2, num_heads=glyph_dim // 8, feed_forward_proj="gated-gelu",
                                             is_encoder_decoder=False)).eval()
    torch.manual_seed(seed + 2)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=16, out_channels=16, num_attention_heads=num_heads, attention_head_dim=head_dim,
        num_layers=num_layers, num_single_layers=num_single_layers, num_refiner_layers=2, mlp_ratio=4.0,
        patch_size=(1, 1), qk_norm="rms_norm", guidance_embeds=distilled, text_embed_dim=text_dim,
        text_embed_2_dim=glyph_dim, rope_theta=256.0, rope_axes_dim=(head_dim // 2, head_dim // 2),
        use_meanflow=distilled,
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=16,
                                    block_out_channels=(32, 32, 64, 64), layers_per_block=1,
                                    spatial_compression_ratio=8, sample_size=64, scaling_factor=0.75289)
    guiders = {}
    if not distilled:
        guiders = {"guider": AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_start_step=1),
                   "ocr_guider": AdaptiveProjectedMixGuidance(guidance_scale=4.5,
                                                              adaptive_projected_guidance_start_step=1)}
    pipe = HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=ByT5Tokenizer(), transformer=transformer,
        **guiders,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True, max_shard_size="300KB")


_DEFAULTS = dict(seed=0, text_dim=64, glyph_dim=32, num_heads=2, head_dim=32, num_layers=2, num_single_layers=2)


@tiny_checkpoint("tencent/HunyuanImage-2.1 (Diffusers) layout: tiny Qwen2.5-VL + ByT5 encoders, 2+2-block MMDiT, "
                 "APG/CFG guiders, tiny 8x VAE", **_DEFAULTS)
def build_hunyuan_image_21(out_dir: Path, **params) -> None:
    _build(out_dir, distilled=False, **params)


@tiny_checkpoint("HunyuanImage-2.1-Distilled (Diffusers) layout: guidance-embedded MeanFlow MMDiT, no guider",
                 **_DEFAULTS)
def build_hunyuan_image_21_distilled(out_dir: Path, **params) -> None:
    _build(out_dir, distilled=True, **params)
