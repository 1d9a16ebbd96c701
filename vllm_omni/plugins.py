"""vLLM plugin hook (entry point group `vllm.general_plugins`): registers our AR model classes.

vLLM calls this in every process it starts, so registration must be idempotent and cheap.
"""

from vllm_omni.model_executor.models.registry import OMNI_AR_MODELS


def register_models() -> None:
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in OMNI_AR_MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
