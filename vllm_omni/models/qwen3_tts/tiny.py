"""Tiny Qwen3-TTS checkpoints in the layout of Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice and -VoiceDesign.

The real repos ship config.json (`model_type` "qwen3_tts": `talker_config` with its `code_predictor_config`,
`speaker_encoder_config`, the model kind `tts_model_type` / `tts_model_size`, legacy `rope_theta` /
`rope_scaling` keys), model.safetensors (`talker.*`), generation_config.json (the sampling defaults the
reference reads, `subtalker_*` included), a Qwen2 BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json)
and `speech_tokenizer/` (config.json with a Mimi `encoder_config` and the `decoder_config`,
preprocessor_config.json, model.safetensors with `encoder.*` and `decoder.*`). Sizes shrink, the structure stays:
a code predictor narrower than the talker (its `small_to_mtp_projection`), codec specials in the top 1024 ids,
dialect speakers, the decoder's real upsample rates (1920 samples per 12.5 Hz frame). The talker's heads are 32
wide (vLLM CPU needs head_dim >= 32).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.catalog.tiny import tiny_checkpoint
from vllm_omni.catalog.tiny_tokenizers import CORPUS, build_qwen_bpe, save_qwen_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
TTS_CORPUS = CORPUS + ["system\nuser\nassistant\n"] * 8
HEAD_DIM = 32
SPEAKERS = ("vivian", "ryan", "dylan")
GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
                     "subtalker_top_k": 50, "max_new_tokens": 8192}


def _talker_config(vocab_size: int, codebook: int, groups: int, hidden: int, layers: int, text_hidden: int,
                   predictor_hidden: int, kind: str) -> dict:
    # Codec ids: 0..codebook-1 are codebook entries, the specials live in the top 1024 ids (as the real 3072).
    base = codebook
    speakers = ({name: base + 300 + i for i, name in enumerate(SPEAKERS)} if kind == "custom_voice" else {})
    return {
        "vocab_size": codebook + 1024, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": hidden // HEAD_DIM, "num_key_value_heads": 1,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": {"interleaved": True, "mrope_section": [6, 5, 5],
                                                "rope_type": "default", "type": "default"},
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "initializer_range": 0.1, "tie_word_embeddings": False, "use_cache": True,
        "num_code_groups": groups, "text_hidden_size": text_hidden, "text_vocab_size": vocab_size,
        "codec_pad_id": base + 4, "codec_bos_id": base + 5, "codec_eos_token_id": base + 6,
        "codec_think_id": base + 10, "codec_nothink_id": base + 11, "codec_think_bos_id": base + 12,
        "codec_think_eos_id": base + 13,
        "codec_language_id": {"chinese": base + 50, "english": base + 51, "german": base + 52,
                              "beijing_dialect": base + 60},
        "spk_id": speakers,
        "spk_is_dialect": {name: ("beijing_dialect" if name == "dylan" else False) for name in speakers},
        "code_predictor_config": {
            "vocab_size": codebook, "hidden_size": predictor_hidden, "intermediate_size": 2 * predictor_hidden,
            "num_hidden_layers": 1, "num_attention_heads": max(predictor_hidden // HEAD_DIM, 1),
            "num_key_value_heads": 1, "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 1,
            "layer_types": ["full_attention"], "attention_dropout": 0.0, "initializer_range": 0.1,
            "num_code_groups": groups, "tie_word_embeddings": False, "use_cache": True,
        },
    }


def _decoder_config(codebook: int, groups: int, width: int) -> dict:
    return {
        "codebook_size": codebook, "codebook_dim": width, "latent_dim": width, "hidden_size": width,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 2 * width, "num_hidden_layers": 1,
        "sliding_window": 72, "num_quantizers": groups, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        "decoder_dim": 32, "max_position_embeddings": 8000, "rope_theta": 10000, "attention_bias": False,
        "hidden_act": "silu", "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5, "attention_dropout": 0.0,
    }


def _encoder_config(codebook: int, groups: int) -> dict:
    """A Mimi encoder at 12.5 Hz (unused for synthesis; present as in the real speech tokenizer)."""
    return {
        "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 32,
        "num_filters": 8, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7,
        "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True,
        "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0, "codebook_size": codebook,
        "codebook_dim": 32, "num_quantizers": groups, "num_semantic_quantizers": 1,
        "vector_quantization_hidden_dimension": 32,
        "upsample_groups": 32, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu", "max_position_embeddings": 8000,
        "rope_theta": 10000.0, "sliding_window": 250, "attention_dropout": 0.0, "norm_eps": 1e-5,
        "use_cache": False, "layer_scale_initial_scale": 0.01, "attention_bias": False,
    }


def _talker_weights(config: dict, seed: int) -> dict:
    """`talker.*` tensors: transformers' dense Qwen3 decoder for the backbone (its `embed_tokens` is the codec
    embedding), the text embedding and projection, the codec head and our code predictor."""
    import torch
    from torch import nn
    from transformers import Qwen3Config, Qwen3Model

    from vllm_omni.models.qwen3_tts.code_predictor import Qwen3TTSCodePredictor
    from vllm_omni.models.qwen3_tts.configuration import Qwen3TTSTalkerConfig

    torch.manual_seed(seed)
    std = config["initializer_range"]
    talker = Qwen3TTSTalkerConfig(**config)
    backbone = Qwen3Model(Qwen3Config(**{k: v for k, v in config.items() if k != "code_predictor_config"}))
    text_embedding = nn.Embedding(config["text_vocab_size"], config["text_hidden_size"])
    fc1 = nn.Linear(config["text_hidden_size"], config["text_hidden_size"])
    fc2 = nn.Linear(config["text_hidden_size"], config["hidden_size"])
    codec_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
    predictor = Qwen3TTSCodePredictor(talker.code_predictor_config, config["hidden_size"])
    for module in (text_embedding, fc1, fc2, codec_head, predictor):
        for name, param in module.named_parameters():
            if "norm" not in name:
                nn.init.normal_(param, 0.0, std)
    tensors = {}
    for name, value in backbone.state_dict().items():
        tensors["talker.model." + name.replace("embed_tokens.", "codec_embedding.")] = value
    tensors["talker.model.text_embedding.weight"] = text_embedding.weight
    for fc, module in (("linear_fc1", fc1), ("linear_fc2", fc2)):
        tensors[f"talker.text_projection.{fc}.weight"], tensors[f"talker.text_projection.{fc}.bias"] = (
            module.weight, module.bias)
    tensors["talker.codec_head.weight"] = codec_head.weight
    for name, value in predictor.state_dict().items():
        if name.startswith("model.small_to_mtp_projection."):
            name = name.removeprefix("model.")
        tensors["talker.code_predictor." + name.replace("model.decoder.", "model.")] = value
    return tensors


def _speech_tokenizer(out: Path, codebook: int, groups: int, width: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import MimiConfig, MimiModel

    from vllm_omni.models.qwen3_omni.tiny import _make_audible
    from vllm_omni.models.qwen3_tts.speech_decoder import Qwen3TTSSpeechDecoder

    torch.manual_seed(seed + 1)
    decoder_config, encoder_config = _decoder_config(codebook, groups, width), _encoder_config(codebook, groups)
    decoder = Qwen3TTSSpeechDecoder(decoder_config)
    _make_audible(decoder)
    with torch.no_grad():  # codebooks as running sums with uneven usage, so every code decodes differently
        for name, param in decoder.named_parameters():
            if name.endswith("embedding_sum"):
                param.normal_(0.0, 1.0)
            elif name.endswith("cluster_usage"):
                param.uniform_(0.5, 2.0)
            elif name.endswith(("input_proj.weight", "output_proj.weight")) and "quantizer" in name:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
    encoder = MimiModel(MimiConfig(**{k: v for k, v in encoder_config.items() if k != "model_type"}))
    tensors = {"decoder." + k: v for k, v in decoder.state_dict().items()}
    tensors.update({"encoder." + k: v for k, v in encoder.state_dict().items()
                    if not k.startswith(("upsample.", "decoder_transformer.", "decoder."))})
    folder = out / "speech_tokenizer"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_config": encoder_config, "decoder_config": decoder_config, "encoder_valid_num_quantizers": groups,
        "input_sample_rate": 24000, "output_sample_rate": 24000, "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920, "transformers_version": "4.57.3",
    }, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "chunk_length_s": None,
        "overlap": None,
    }, indent=2))


def _build(out: Path, *, kind: str, size: str, vocab_size: int, codebook_size: int, num_code_groups: int,
           hidden: int, layers: int, text_hidden: int, predictor_hidden: int, decoder_width: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    tok = build_qwen_bpe(vocab_size, corpus=TTS_CORPUS, special_tokens=SPECIAL_TOKENS)
    save_qwen_tokenizer(out, tok, chat_template=None, special_tokens=SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    talker = _talker_config(tok.get_vocab_size(), codebook_size, num_code_groups, hidden, layers, text_hidden,
                            predictor_hidden, kind)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": size, "tts_model_type": kind,
        "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
        "tts_eos_token_id": ids["<tts_text_eod>"], "talker_config": talker,
        "speaker_encoder_config": {"enc_dim": hidden, "sample_rate": 24000},
        "torch_dtype": "float32", "transformers_version": "4.57.3",
    }, indent=2))
    tensors = _talker_weights(talker, seed)
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    _speech_tokenizer(out, codebook_size, num_code_groups, decoder_width, seed)


SIZES = {"vocab_size": 1024, "codebook_size": 256, "num_code_groups": 4, "hidden": 64, "layers": 2,
         "text_hidden": 48, "predictor_hidden": 32, "decoder_width": 64, "seed": 0}


@tiny_checkpoint("Qwen3-TTS talker/code predictor/speech tokenizer, named voices (layout of "
                 "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice)", **SIZES)
def build_qwen3_tts(out: Path, **sizes) -> None:
    _build(out, kind="custom_voice", size="1b7", **sizes)


@tiny_checkpoint("Qwen3-TTS with voice design from `instructions` (layout of Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign)",
                 **SIZES)
def build_qwen3_tts_voice_design(out: Path, **sizes) -> None:
    _build(out, kind="voice_design", size="1b7", **sizes)
