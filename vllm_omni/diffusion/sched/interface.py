"""The sampling-params key: two requests may share a forward only when their keys are equal.

Everything that changes tensor shapes, the denoise schedule, the guidance path or the model's weights is
in the key; per-request values a batched pipeline handles row by row (prompt text, seed) are not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_omni.diffusion.request import OmniDiffusionRequest


@dataclass(frozen=True)
class RequestBatchSamplingParamsKey:
    height: int | None
    width: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    guidance_scale_2: float | None
    true_cfg_scale: float | None
    has_negative_prompt: bool
    num_outputs_per_prompt: int
    quality: str | None
    """None (server default) and "lossless" are different keys on purpose."""
    output_type: str
    num_frames: int | None
    fps: int | None
    boundary_ratio: float | None
    flow_shift: float | None
    max_sequence_length: int | None
    lora: str | None
    extra_args: str
    num_input_images: int


def build_request_batch_sampling_params_key(request: OmniDiffusionRequest) -> RequestBatchSamplingParamsKey:
    sp = request.sampling_params
    images = request.multi_modal_data.get("image")
    num_images = 0 if images is None else (len(images) if isinstance(images, list | tuple) else 1)
    return RequestBatchSamplingParamsKey(
        height=sp.height,
        width=sp.width,
        num_inference_steps=sp.num_inference_steps,
        guidance_scale=sp.guidance_scale,
        guidance_scale_2=sp.guidance_scale_2,
        true_cfg_scale=sp.true_cfg_scale,
        has_negative_prompt=request.negative_prompt is not None,
        num_outputs_per_prompt=sp.num_outputs_per_prompt,
        quality=sp.quality,
        output_type=sp.output_type,
        num_frames=sp.num_frames,
        fps=sp.fps,
        boundary_ratio=sp.boundary_ratio,
        flow_shift=sp.flow_shift,
        max_sequence_length=sp.max_sequence_length,
        lora=_stable_json(sp.lora),
        extra_args=_stable_json(sp.extra_args) or "{}",
        num_input_images=num_images,
    )


def _stable_json(value: object) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=repr)
