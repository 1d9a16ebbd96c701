"""Qwen3-TTS: talker (AR, our vLLM model, with its code predictor) -> speech-tokenizer decoder (GENERATION)."""

from vllm_omni.catalog.spec import ModelSpec

SPEC = ModelSpec(
    family="qwen3_tts",
    description="Qwen/Qwen3-TTS-12Hz-*-CustomVoice / -VoiceDesign: text in, speech out (named voices or a "
                "described voice)",
    architectures=("Qwen3TTSForConditionalGeneration", "qwen3_tts"),
    topology="vllm_omni.models.qwen3_tts.pipeline:qwen3_tts_pipeline",
    input_modalities=frozenset({"text"}),
    output_modalities=frozenset({"audio"}),
    ar_models={"Qwen3TTSTalkerForConditionalGeneration":
               "vllm_omni.models.qwen3_tts.vllm_talker:Qwen3TTSTalkerForConditionalGeneration"},
    hf_configs={"qwen3_tts": "vllm_omni.models.qwen3_tts.configuration:Qwen3TTSConfig",
                "qwen3_tts_talker": "vllm_omni.models.qwen3_tts.configuration:Qwen3TTSTalkerConfig",
                "qwen3_tts_talker_code_predictor":
                "vllm_omni.models.qwen3_tts.configuration:Qwen3TTSCodePredictorConfig"},
    stage_input_processors={
        "qwen3_tts_text_to_talker": "vllm_omni.models.qwen3_tts.pipeline:text_to_talker_request",
        "qwen3_tts_talker_to_decoder": "vllm_omni.models.qwen3_omni.pipeline:talker_to_code2wav_chunks",
    },
    output_collectors={"qwen3_tts_talker_frames": "vllm_omni.models.qwen3_omni.pipeline:collect_talker_frames"},
    tiny={"qwen3-tts": "vllm_omni.models.qwen3_tts.tiny:build_qwen3_tts",
          "qwen3-tts-voice-design": "vllm_omni.models.qwen3_tts.tiny:build_qwen3_tts_voice_design"},
)
