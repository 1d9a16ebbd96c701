"""Qwen3-TTS checkpoint configs (`model_type` "qwen3_tts"), which transformers does not ship.

The talker and its code predictor are dense Qwen3 decoders, so their configs are `Qwen3Config`s with the few
extra fields the checkpoint carries (codec special ids, speakers, languages, the text embedding's size). They are
registered with transformers' `AutoConfig` (the spec's `hf_configs`, by our vLLM plugin) so vLLM reads the
checkpoint like any other.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config


class Qwen3TTSCodePredictorConfig(Qwen3Config):
    """The code predictor: a small Qwen3 decoder that fills codebooks 1..G-1 of each frame."""

    model_type = "qwen3_tts_talker_code_predictor"

    def __init__(self, num_code_groups: int = 32, **kwargs: Any) -> None:
        self.num_code_groups = num_code_groups
        super().__init__(**kwargs)


class Qwen3TTSTalkerConfig(Qwen3Config):
    """The talker: a Qwen3 decoder over codec ids (codebook 0) conditioned on projected text embeddings."""

    model_type = "qwen3_tts_talker"
    sub_configs = {"code_predictor_config": Qwen3TTSCodePredictorConfig}

    def __init__(self, code_predictor_config: dict | Qwen3TTSCodePredictorConfig | None = None,
                 num_code_groups: int = 32, text_hidden_size: int = 2048, text_vocab_size: int = 151936,
                 codec_eos_token_id: int = 4198, codec_think_id: int = 4202, codec_nothink_id: int = 4203,
                 codec_think_bos_id: int = 4204, codec_think_eos_id: int = 4205, codec_pad_id: int = 4196,
                 codec_bos_id: int = 4197, spk_id: dict[str, int] | None = None,
                 spk_is_dialect: dict[str, str | bool] | None = None,
                 codec_language_id: dict[str, int] | None = None, **kwargs: Any) -> None:
        if not isinstance(code_predictor_config, Qwen3TTSCodePredictorConfig):
            code_predictor_config = Qwen3TTSCodePredictorConfig(**(code_predictor_config or {}))
        self.code_predictor_config = code_predictor_config
        self.num_code_groups = num_code_groups
        self.text_hidden_size = text_hidden_size
        self.text_vocab_size = text_vocab_size
        self.codec_eos_token_id = codec_eos_token_id
        self.codec_think_id = codec_think_id
        self.codec_nothink_id = codec_nothink_id
        self.codec_think_bos_id = codec_think_bos_id
        self.codec_think_eos_id = codec_think_eos_id
        self.codec_pad_id = codec_pad_id
        self.codec_bos_id = codec_bos_id
        self.spk_id = dict(spk_id or {})
        self.spk_is_dialect = dict(spk_is_dialect or {})
        self.codec_language_id = dict(codec_language_id or {})
        super().__init__(**kwargs)


class Qwen3TTSConfig(PretrainedConfig):
    """The whole checkpoint: the talker (with its code predictor), the Base model's speaker encoder, the model
    kind (`tts_model_type`: "custom_voice", "voice_design" or "base") and the text special ids."""

    model_type = "qwen3_tts"
    sub_configs = {"talker_config": Qwen3TTSTalkerConfig}

    def __init__(self, talker_config: dict | Qwen3TTSTalkerConfig | None = None,
                 speaker_encoder_config: dict | None = None, tokenizer_type: str | None = None,
                 tts_model_size: str | None = None, tts_model_type: str | None = None,
                 im_start_token_id: int = 151644, im_end_token_id: int = 151645, tts_pad_token_id: int = 151671,
                 tts_bos_token_id: int = 151672, tts_eos_token_id: int = 151673, **kwargs: Any) -> None:
        if not isinstance(talker_config, Qwen3TTSTalkerConfig):
            talker_config = Qwen3TTSTalkerConfig(**(talker_config or {}))
        self.talker_config = talker_config
        self.speaker_encoder_config = dict(speaker_encoder_config or {})
        self.tokenizer_type = tokenizer_type
        self.tts_model_size = tts_model_size
        self.tts_model_type = tts_model_type
        self.im_start_token_id = im_start_token_id
        self.im_end_token_id = im_end_token_id
        self.tts_pad_token_id = tts_pad_token_id
        self.tts_bos_token_id = tts_bos_token_id
        self.tts_eos_token_id = tts_eos_token_id
        super().__init__(**kwargs)

