"""AR model classes vllm-omni adds to vLLM's registry (architecture name -> "module:Class")."""

OMNI_AR_MODELS: dict[str, str] = {
    "Qwen3OmniMoeTalkerForConditionalGeneration":
        "vllm_omni.model_executor.models.qwen3_omni.vllm_talker:Qwen3OmniMoeTalkerForConditionalGeneration",
}
