"""The sampling-params key: two requests may share a forward only when their keys are equal.

Everything that changes tensor shapes, the denoise schedule, the guidance path or the model's weights is
in the key; per-request values a batched pipeline handles row by row (prompt text, seed) are not. Which
sampling params those are is declared once, by the `batch_key` metadata of `OmniDiffusionSamplingParams`.
LoRA adapters run row by row in a co-batched forward (`diffusion/lora.py`), so they are in the key only where
rows cannot mix: a distributed-layerwise-offload wave, whose ranks each run their own request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import knob_names
from vllm_omni.inputs.lora import parse_lora, parse_refine_lora


@dataclass(frozen=True)
class RequestBatchSamplingParamsKey:
    params: tuple[tuple[str, object], ...]
    """(name, value) of every `batch_key` sampling param; dicts as stable JSON. quality None (server default)
    and "lossless" are different keys on purpose."""
    has_negative_prompt: bool
    num_input_images: int
    lora: tuple[tuple[str, float], ...] = ()
    """The adapter identity, (path, or the name while unresolved; scale) of each adapter, sorted: filled only in
    keys built with `lora=True`."""


def build_request_batch_sampling_params_key(
    request: OmniDiffusionRequest, lora: bool = False
) -> RequestBatchSamplingParamsKey:
    """The request's key; `lora`: with its adapter identity (where rows of different adapters cannot mix)."""
    sp = request.sampling_params
    images = request.multi_modal_data.get("image")
    num_images = 0 if images is None else (len(images) if isinstance(images, list | tuple) else 1)
    refs = (*parse_lora(sp.lora), *filter(None, [parse_refine_lora(sp.refine_lora)])) if lora else ()
    adapters = tuple(sorted((ref.path or ref.name, ref.scale) for ref in refs))
    return RequestBatchSamplingParamsKey(
        params=tuple((name, _hashable(getattr(sp, name))) for name in knob_names(batch_key=True)),
        has_negative_prompt=request.negative_prompt is not None,
        num_input_images=num_images,
        lora=adapters,
    )


def _hashable(value: object) -> object:
    return json.dumps(value, sort_keys=True, default=repr) if isinstance(value, dict | list) else value
