"""The Qwen3-Omni thinker stage: vLLM's own `Qwen3OmniMoeThinkerForConditionalGeneration` (audio tower, vision
tower, MoE decoder, vLLM's multimodal processor), registered under its own architecture name only so that its
processing info can hand vLLM a Hugging Face processor that works without torchvision
(`qwen3_omni_processor`). With torchvision installed it is vLLM's processor, unchanged.

When the stage runs with `ThinkerHiddenStatesConnector` (thinker_hidden.py), the model also keeps the hidden
states of the talker's `accept_hidden_layer` (vLLM's aux-hidden-state hook of the decoder) and hands each
forward's prompt rows to the connector, which files them per request for the talker."""

from __future__ import annotations

from functools import cached_property

import torch
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

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        talker = getattr(vllm_config.model_config.hf_config, "talker_config", None)
        self._export = vllm_config.kv_transfer_config is not None and talker is not None
        self._accept_layer = talker.accept_hidden_layer if self._export else 0
        if self._export:
            # The decoder then returns (hidden, [residual stream after `accept_hidden_layer` layers]).
            self.language_model.model.aux_hidden_state_layers = (self._accept_layer,)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        deepstack = self._deepstack_in_accepted(inputs_embeds)
        out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if not self._export or not isinstance(out, tuple):
            return out
        hidden, (accepted,) = out
        if deepstack is not None:
            accepted = accepted - deepstack
        self._file_prompt_rows(positions, accepted)
        return hidden

    def _deepstack_in_accepted(self, inputs_embeds: torch.Tensor | None) -> torch.Tensor | None:
        """vLLM's state after layer k-1 includes the deepstack visual embedding added after that layer;
        transformers' `hidden_states[k]` is the layer's output before it (what the talker was trained on)."""
        level = self._accept_layer - 1
        if (not self._export or inputs_embeds is None or level < 0 or not getattr(self, "use_deepstack", False)
                or level >= self.deepstack_num_level):
            return None
        return self.deepstack_input_embeds[level][:inputs_embeds.shape[0]].clone()

    @staticmethod
    def _file_prompt_rows(positions: torch.Tensor, accepted: torch.Tensor) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.forward_context import get_forward_context

        from vllm_omni.models.qwen3_omni.thinker_hidden import ThinkerHiddenStatesConnector

        if not has_kv_transfer_group() or not isinstance(get_kv_transfer_group(), ThinkerHiddenStatesConnector):
            return
        slots = get_forward_context().slot_mapping
        if isinstance(slots, list):  # micro-batches are not used with this stage
            return
        if not slots:
            return
        slot_mapping = next(iter(slots.values()))[:accepted.shape[0]]
        positions = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(3, -1)
        get_kv_transfer_group().capture(slot_mapping, positions[:, :accepted.shape[0]], accepted)
