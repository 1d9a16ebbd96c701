"""vLLM plugin hook (entry point group `vllm.general_plugins`): registers our AR model classes.

vLLM calls this in every process it starts, so registration must be idempotent and cheap.
"""

from vllm_omni.models.registry import MODEL_REGISTRY


def register_models() -> None:
    from vllm import ModelRegistry

    from vllm_omni.models.qwen3_omni.compat import alias_qwen2_vl_image_processing

    alias_qwen2_vl_image_processing()  # vLLM's Qwen-VL/Omni models import torchvision-only code otherwise

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in MODEL_REGISTRY.ar_models().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
