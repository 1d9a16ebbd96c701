"""The Qwen3-Omni thinker stage: vLLM's own `Qwen3OmniMoeThinkerForConditionalGeneration` (audio tower, vision
tower, MoE decoder, vLLM's multimodal processor), registered under its own architecture name only so that its
processing info can hand vLLM a Hugging Face processor that works without torchvision
(`qwen3_omni_processor`). With torchvision installed it is vLLM's processor, unchanged."""

from __future__ import annotations

from functools import cached_property

from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerDummyInputsBuilder,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerMultiModalProcessor,
    Qwen3OmniMoeThinkerProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vllm_omni.models.qwen3_omni.processing import has_torchvision, qwen3_omni_processor

ARCHITECTURE = "Qwen3OmniMoeOmniThinkerForConditionalGeneration"


class Qwen3OmniThinkerProcessingInfo(Qwen3OmniMoeThinkerProcessingInfo):
    def get_hf_processor(self, **kwargs: object):
        """Per-call processor kwargs reach the processor's `__call__` (vLLM passes them there too), so one
        processor per model serves every request."""
        if has_torchvision():
            return super().get_hf_processor(**kwargs)
        return self._torchvision_free_processor

    @cached_property
    def _torchvision_free_processor(self):
        config = self.ctx.model_config
        return qwen3_omni_processor(config.model, tokenizer=self.ctx.tokenizer, revision=config.revision,
                                    trust_remote_code=config.trust_remote_code)


@MULTIMODAL_REGISTRY.register_processor(Qwen3OmniMoeThinkerMultiModalProcessor, info=Qwen3OmniThinkerProcessingInfo,
                                        dummy_inputs=Qwen3OmniMoeThinkerDummyInputsBuilder)
class Qwen3OmniMoeOmniThinkerForConditionalGeneration(Qwen3OmniMoeThinkerForConditionalGeneration):
    """vLLM's thinker with the processing info above; weights, forward and multimodal merging are vLLM's."""
