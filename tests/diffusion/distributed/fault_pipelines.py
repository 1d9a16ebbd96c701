"""Tiny Qwen-Image with faults injected on chosen ranks (importable by name in the spawned workers).

The prompt says where: "fault-forward" raises on rank 1 as its step-1 transformer forward starts (its peers are
then inside that forward's collectives, waiting for it), "fault-decode" raises on rank 1 in the VAE decode
(after the last collective), "fault-decode-all" raises the same error on every rank in the decode. Any other
prompt runs the real pipeline unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline


def _rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank_in_group


def _prompts(states) -> set[str]:
    return {request.prompt_text for state in states for request in state.requests}


class FaultyQwenImagePipeline(QwenImagePipeline):
    def forward_step_inputs(self, inputs, states) -> list[torch.Tensor]:
        if "fault-forward" in _prompts(states) and states[0].step_index == 1 and _rank() == 1:
            raise RuntimeError("injected fault in the forward on rank 1")
        return super().forward_step_inputs(inputs, states)

    def decode(self, state) -> Any:
        prompts = _prompts([state])
        if "fault-decode-all" in prompts:
            raise RuntimeError("injected fault in the decode on every rank")
        if "fault-decode" in prompts and _rank() == 1:
            raise RuntimeError("injected fault in the decode on rank 1")
        return super().decode(state)
