"""Tiny Qwen3-Omni (thinker -> talker -> code2wav) in the layout of Qwen/Qwen3-Omni-30B-A3B-Instruct.

The real repo ships one config.json (`thinker_config`, `talker_config`, `code2wav_config`), sharded
`model-0000X-of-0000N.safetensors` with `model.safetensors.index.json`, a Qwen2 BPE tokenizer, a chat
template and the processor configs (Whisper feature extractor, Qwen2-VL image/video processors).
Sizes are shrunk but every structural trait is kept: MoE thinker and talker (few experts; the talker's
experts have a shared expert), a code predictor filling the residual codebooks, code2wav's real upsample
rates (1920 samples per codec frame). All attention heads are 32 wide (vLLM CPU needs head_dim >= 32).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import CORPUS, build_qwen_bpe, save_qwen_tokenizer

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
]

# Role words must be single tokens right after <|im_start|> (the talker finds user turns by them).
OMNI_CORPUS = CORPUS + ["system\nuser\nassistant\n"] * 8

CHAT_TEMPLATE = (
    "{% set media = {'audio': '<|audio_start|><|audio_pad|><|audio_end|>', "
    "'audio_url': '<|audio_start|><|audio_pad|><|audio_end|>', "
    "'image': '<|vision_start|><|image_pad|><|vision_end|>', "
    "'image_url': '<|vision_start|><|image_pad|><|vision_end|>', "
    "'video': '<|vision_start|><|video_pad|><|vision_end|>', "
    "'video_url': '<|vision_start|><|video_pad|><|vision_end|>'} %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ media[part['type']] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

HEAD_DIM = 32
# mrope sections (temporal, height, width) over head_dim / 2 rotary frequencies, interleaved like the real model.
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5], "interleaved": True,
        "mrope_interleaved": True}


def _ids(tok) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    for role in ("system", "user", "assistant"):
        enc = tok.encode(f"<|im_start|>{role}\n").ids
        if len(enc) != 3:
            raise RuntimeError(f"tiny tokenizer must encode role {role!r} as one token, got {enc}")
        ids[role] = enc[1]
    return ids


def _thinker_config(ids: dict[str, int], vocab_size: int, hidden: int, layers: int) -> dict:
    return {
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "d_model": 64, "output_dim": hidden, "downsample_hidden_size": 32, "n_window": 50,
            "n_window_infer": 400, "conv_chunksize": 500, "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden, "image_size": 128,
            "apply_vit_abs_pos_embed": True, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        "text_config": {
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": hidden // HEAD_DIM, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096,
            "rope_parameters": ROPE, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        },
        "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "user_token_id": ids["user"], "position_id_per_seconds": 13,
    }


def _talker_config(ids: dict[str, int], thinker_hidden: int, codebook: int, groups: int) -> dict:
    # Codec ids: 0..codebook-1 are codebook entries, specials live in the top 1024 ids (generate() suppresses
    # that range except codec EOS), exactly like the real 3072-entry codec vocabulary.
    vocab = codebook + 1024
    special = {"codec_pad_id": codebook + 4, "codec_bos_id": codebook + 5, "codec_eos_token_id": codebook + 6,
               "codec_nothink_id": codebook + 11, "codec_think_bos_id": codebook + 12,
               "codec_think_eos_id": codebook + 13}
    return {
        "text_config": {
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 4096, "rope_parameters": ROPE, "rms_norm_eps": 1e-6,
        },
        "code_predictor_config": {
            "vocab_size": codebook, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM, "num_code_groups": groups,
            "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
        },
        "num_code_groups": groups, "thinker_hidden_size": thinker_hidden, "accept_hidden_layer": 1,
        **special,
        "speaker_id": {"ethan": codebook + 300, "chelsie": codebook + 301, "aiden": codebook + 302},
        "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "position_id_per_seconds": 13, "spatial_merge_size": 2,
    }


def _code2wav_config(codebook: int, groups: int) -> dict:
    return {
        "codebook_size": codebook, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 1, "sliding_window": 72, "num_quantizers": groups,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32,
        "max_position_embeddings": 8000, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5,
    }


def _make_audible(code2wav) -> None:
    """Re-draw the vocoder's convolutions at unit gain: with the generic init its output is ~1e-8, which would
    make any waveform comparison vacuous. The last convolution scales down so samples stay inside [-1, 1]."""
    import math

    import torch

    convs = [m for m in code2wav.modules() if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)]
    with torch.no_grad():
        for conv in convs:
            fan_in = conv.in_channels // conv.groups * conv.kernel_size[0]
            if isinstance(conv, torch.nn.ConvTranspose1d):
                fan_in = conv.in_channels * conv.kernel_size[0] / conv.stride[0]
            conv.weight.normal_(0.0, (0.002 if conv is convs[-1] else 1.0) / math.sqrt(fan_in))
        for name, param in code2wav.named_parameters():
            if name.endswith("gamma"):
                param.fill_(0.1)


def _draw_talker_experts(talker, std: float) -> None:
    """transformers' init leaves the talker's MoE experts as allocated: whatever the building process's allocator
    held (near-zero on a fresh process, NaN or 1e36 after other work), so the checkpoint depended on what ran
    before it. Drawn here, after the seeded init, like every other weight."""
    import torch

    for name, param in talker.named_parameters():
        if ".mlp.experts." in name:
            torch.nn.init.normal_(param, 0.0, std)


def _write_processor_configs(out: Path) -> None:
    (out / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
        "hop_length": 160, "chunk_length": 300, "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.00392156862745098, "min_pixels": 3136, "max_pixels": 50176, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "processor_class": "Qwen3OmniMoeProcessor",
    }, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))


@tiny_checkpoint("Qwen3-Omni MoE thinker/talker/code2wav (layout of Qwen/Qwen3-Omni-30B-A3B-Instruct)",
               vocab_size=1024, thinker_hidden=96, thinker_layers=2, codebook_size=256, num_code_groups=4,
               num_shards=3, seed=0, revision=5)
def build_qwen3_omni(out: Path, *, vocab_size: int, thinker_hidden: int, thinker_layers: int, codebook_size: int,
                     num_code_groups: int, num_shards: int, seed: int, revision: int) -> None:
    # `revision` is part of the cache key: bump it when a helper above changes the written checkpoint.
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    tok = build_qwen_bpe(vocab_size, corpus=OMNI_CORPUS, special_tokens=SPECIAL_TOKENS)
    save_qwen_tokenizer(out, tok, chat_template=CHAT_TEMPLATE, special_tokens=SPECIAL_TOKENS, extra_config={
        "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
        "processor_class": "Qwen3OmniMoeProcessor",
    })
    ids = _ids(tok)
    config = Qwen3OmniMoeConfig(
        thinker_config=_thinker_config(ids, tok.get_vocab_size(), thinker_hidden, thinker_layers),
        talker_config=_talker_config(ids, thinker_hidden, codebook_size, num_code_groups),
        code2wav_config=_code2wav_config(codebook_size, num_code_groups),
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"], architectures=["Qwen3OmniMoeForConditionalGeneration"],
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 keeps greedy argmax margins clear of float rounding on tiny widths.
    config.initializer_range = config.thinker_config.initializer_range = 0.1
    model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32)
    _draw_talker_experts(model.talker, config.talker_config.text_config.initializer_range)
    _make_audible(model.code2wav)
    total = sum(p.numel() * 2 for p in model.parameters())  # bf16 bytes on disk
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=max(total // num_shards + 1, 1))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": False,
    }, indent=2))
    _write_processor_configs(out)
