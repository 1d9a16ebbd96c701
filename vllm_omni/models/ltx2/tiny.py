"""Tiny LTX-2 checkpoint in the layout of the Lightricks/LTX-2 diffusers repo.

Real repo: model_index.json (LTX2Pipeline), scheduler/ (FlowMatchEulerDiscreteScheduler with dynamic shifting),
text_encoder/ (Gemma3ForConditionalGeneration, sharded + index), tokenizer/ (Gemma tokenizer), connectors/
(LTX2TextConnectors), transformer/ (LTX2VideoTransformer3DModel, sharded + index), vae/ (AutoencoderKLLTX2Video),
audio_vae/ (AutoencoderKLLTX2Audio), vocoder/ (LTX2Vocoder) and latent_upsampler/ (LTX2LatentUpsamplerModel, the
x2 spatial upsampler of the two-stage variant: not in model_index.json, loaded by
`LTX2LatentUpsamplerModel.from_pretrained(repo, subfolder="latent_upsampler")` as diffusers' docs do), and at the
root, beside them, `ltx-2-19b-distilled-lora-384.safetensors` (the refine pass's distilled LoRA, in LTX-2's own key
layout `diffusion_model.transformer_blocks.N.<attn / ff projection>.lora_A/B.weight`, which diffusers'
`LTX2LoraLoaderMixin` converts; ours at rank 4 on the blocks' attention and MLP projections). The same files with
tiny random weights, so diffusers' LTX2Pipeline, LTX2LatentUpsamplePipeline and `load_lora_weights` load them
offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint

_CORPUS = [
    "A cat walks on the grass while birds sing, camera slowly pans left.",
    "A man plays a red electric guitar on a stage, the crowd cheers.",
    "Ocean waves crash against the rocks, wind howls over the water.",
    "worst quality, inconsistent motion, blurry, jittery, distorted, muffled sound",
    "A dog barks and runs through a field of flowers on a sunny morning.",
    "1 2 3 4 5 6 7 8 9 10 one two three four five six seven eight nine ten",
]
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]

# Flow-match scheduler of the real repo (dynamic exponential shift from the video token count).
_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 1024,
    "base_shift": 0.95,
    "invert_sigmas": False,
    "max_image_seq_len": 4096,
    "max_shift": 2.05,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.1,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def _gemma_tokenizer():
    """A Gemma-style BPE (pad=0, eos=1, bos=2, unk=3, `<bos> $A`), trained on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GemmaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        _CORPUS * 4, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=_GEMMA_SPECIALS, show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    tokenizer = GemmaTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.model_max_length = 1024
    return tokenizer


@tiny_checkpoint(
    "Lightricks/LTX-2 layout: tiny Gemma3 encoder + connectors, 2-block audio-video DiT, video VAE, audio VAE, vocoder",
    seed=0,
    text_dim=32,
    heads=2,
    head_dim=8,
    audio_head_dim=4,
    num_layers=2,
)
def build_ltx2(
    out: Path, *, seed: int, text_dim: int, heads: int, head_dim: int, audio_head_dim: int, num_layers: int
) -> None:
    import torch
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora
    from vllm_omni.models.ltx2.pipeline import DISTILLED_LORA

    tokenizer = _gemma_tokenizer()
    torch.manual_seed(seed)
    text_layers = 2
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=2 * text_dim,
                num_hidden_layers=text_layers,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                sliding_window=8,
                max_position_embeddings=1024,
                pad_token_id=0,
                eos_token_id=1,
                bos_token_id=2,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=8,
            ),
            mm_tokens_per_image=4,
            image_token_index=len(tokenizer) - 1,
            boi_token_index=len(tokenizer) - 2,
            eoi_token_index=len(tokenizer) - 3,
        )
    ).eval()
    torch.manual_seed(seed + 1)
    connectors = LTX2TextConnectors(
        caption_channels=text_dim,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=text_dim // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=text_dim // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32,
        rope_type="split",
    )
    torch.manual_seed(seed + 2)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=heads,
        audio_attention_head_dim=audio_head_dim,
        audio_cross_attention_dim=heads * audio_head_dim,
        num_layers=num_layers,
        caption_channels=text_dim,
        rope_type="split",
        vae_scale_factors=(2, 2, 2),
        audio_scale_factor=4,
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    torch.manual_seed(seed + 7)
    # LTX-2.0's upsampler config (3D convolutions, rational x2 resampler), at a tiny width (GroupNorm needs 32).
    latent_upsampler = LTX2LatentUpsamplerModel(
        in_channels=8,
        mid_channels=32,
        num_blocks_per_stage=1,
        dims=3,
        spatial_upsample=True,
        temporal_upsample=False,
        rational_spatial_scale=2.0,
        use_rational_resampler=True,
    )
    # Random weights in the VAEs' statistics buffers would be zeros / ones; draw them so (de)normalization counts.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 6)
        for module in (vae, audio_vae):
            module.latents_mean.copy_(0.1 * torch.randn(module.latents_mean.shape, generator=gen))
            module.latents_std.copy_(1.0 + 0.2 * torch.rand(module.latents_std.shape, generator=gen))
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in _SCHEDULER_CONFIG.items() if k[0] != "_"})
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    # The real repo shards text_encoder and transformer (several files + an index); so do we.
    pipe.save_pretrained(out, safe_serialization=True, max_shard_size="100KB")
    for name, module in (("connectors", connectors), ("vae", vae)):  # one file each in the real repo
        shutil.rmtree(out / name)
        module.save_pretrained(out / name, safe_serialization=True)
    latent_upsampler.save_pretrained(out / "latent_upsampler", safe_serialization=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER_CONFIG, indent=2))
    write_tiny_lora(out, out / DISTILLED_LORA, prefix="diffusion_model", rank=4, std=1.0, seed=seed + 8)
