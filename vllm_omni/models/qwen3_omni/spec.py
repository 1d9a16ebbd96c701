"""Qwen3-Omni: thinker (AR, vLLM's model) -> talker (AR, our vLLM model) -> Code2Wav (GENERATION)."""

from vllm_omni.catalog.spec import ModelSpec

SPEC = ModelSpec(
    family="qwen3_omni",
    description="Qwen/Qwen3-Omni-30B-A3B-Instruct: text, audio, image and video in; text + speech out",
    # The thinker stage runs under our architecture name (vllm_thinker.py); it is still this family.
    architectures=("Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe",
                   "Qwen3OmniMoeOmniThinkerForConditionalGeneration"),
    topology="vllm_omni.models.qwen3_omni.pipeline:qwen3_omni_pipeline",
    input_modalities=frozenset({"text", "audio", "image", "video"}),
    output_modalities=frozenset({"text", "audio"}),
    ar_models={"Qwen3OmniMoeTalkerForConditionalGeneration":
               "vllm_omni.models.qwen3_omni.vllm_talker:Qwen3OmniMoeTalkerForConditionalGeneration",
               "Qwen3OmniMoeOmniThinkerForConditionalGeneration":
               "vllm_omni.models.qwen3_omni.vllm_thinker:Qwen3OmniMoeOmniThinkerForConditionalGeneration"},
    stage_input_processors={
        "qwen3_omni_thinker_to_talker": "vllm_omni.models.qwen3_omni.pipeline:thinker_to_talker_request",
        "qwen3_omni_talker_to_code2wav": "vllm_omni.models.qwen3_omni.pipeline:talker_to_code2wav_chunks",
    },
    output_collectors={"qwen3_omni_talker_frames": "vllm_omni.models.qwen3_omni.pipeline:collect_talker_frames",
                       "qwen3_omni_thinker_hidden": "vllm_omni.models.qwen3_omni.pipeline:collect_thinker_hidden"},
    tiny={"qwen3-omni": "vllm_omni.models.qwen3_omni.tiny:build_qwen3_omni"},
)
