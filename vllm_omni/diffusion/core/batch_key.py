"""The sampling-params key: two requests may share a forward only when their keys are equal.

Everything that changes tensor shapes, the denoise schedule, the guidance path or the model's weights is
in the key; per-request values a batched pipeline handles row by row (prompt text, seed) are not. Which
sampling params those are is declared once, by the `batch_key` metadata of `OmniDiffusionSamplingParams`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import knob_names


@dataclass(frozen=True)
class RequestBatchSamplingParamsKey:
    params: tuple[tuple[str, object], ...]
    """(name, value) of every `batch_key` sampling param; dicts as stable JSON. quality None (server default)
    and "lossless" are different keys on purpose."""
    has_negative_prompt: bool
    num_input_images: int


def build_request_batch_sampling_params_key(request: OmniDiffusionRequest) -> RequestBatchSamplingParamsKey:
    sp = request.sampling_params
    images = request.multi_modal_data.get("image")
    num_images = 0 if images is None else (len(images) if isinstance(images, list | tuple) else 1)
    return RequestBatchSamplingParamsKey(
        params=tuple((name, _hashable(getattr(sp, name))) for name in knob_names(batch_key=True)),
        has_negative_prompt=request.negative_prompt is not None,
        num_input_images=num_images,
    )


def _hashable(value: object) -> object:
    return json.dumps(value, sort_keys=True, default=repr) if isinstance(value, dict | list) else value
