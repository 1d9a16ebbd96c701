"""AR model classes vllm-omni adds to vLLM's registry (architecture name -> "module:Class")."""

OMNI_AR_MODELS: dict[str, str] = {}
