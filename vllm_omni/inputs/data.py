"""Per-stage sampling parameters for diffusion stages.

AR stages take vLLM's own `SamplingParams`; diffusion stages take `OmniDiffusionSamplingParams`.
Invalid values fail at construction with an `OmniClientError` naming the field, so a bad request never
reaches a worker.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from vllm_omni.errors import OmniClientError

Quality = Literal["lossless", "high"]
OutputType = Literal["pil", "np", "pt", "latent"]
QUALITY_VALUES: tuple[str, ...] = ("lossless", "high")
MAX_OUTPUTS_PER_PROMPT = 16
MAX_IMAGE_SIDE = 8192


@dataclass
class OmniDiffusionSamplingParams:
    """What a diffusion request asks for. `None` means "the pipeline's default"."""

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    """Distilled guidance (FLUX) or classic CFG (Wan); Qwen-Image uses `true_cfg_scale`."""
    guidance_scale_2: float | None = None
    """Wan2.2 low-noise expert guidance."""
    true_cfg_scale: float | None = None
    """Classifier-free guidance with a negative prompt; CFG runs when > 1 and a negative prompt exists."""
    negative_prompt: str | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    quality: Quality | None = None
    """`lossless`: reference path; `high`: the model's conservative cache profile; None: server default."""
    output_type: OutputType = "pil"
    num_frames: int | None = None
    fps: int | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    max_sequence_length: int | None = None
    lora: dict[str, Any] | None = None
    stream_partial_outputs: bool = False
    """Stream denoise progress and decoded video chunks as unfinished outputs before the final one (AsyncOmni).
    Not part of the batching key: streaming and non-streaming requests share forwards."""
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._validate_sizes()
        self._validate_guidance()
        self._validate_choices()

    def _validate_sizes(self) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 8 <= value <= MAX_IMAGE_SIDE):
                raise OmniClientError(f"{name} must be an integer in [8, {MAX_IMAGE_SIDE}], got {value!r}", param=name)
        for name in ("num_inference_steps", "num_frames", "fps", "max_sequence_length"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise OmniClientError(f"{name} must be a positive integer, got {value!r}", param=name)
        n = self.num_outputs_per_prompt
        if not _is_int(n) or not 1 <= n <= MAX_OUTPUTS_PER_PROMPT:
            raise OmniClientError(
                f"num_outputs_per_prompt must be an integer in [1, {MAX_OUTPUTS_PER_PROMPT}], got {n!r}",
                param="num_outputs_per_prompt",
            )
        if self.seed is not None and not _is_int(self.seed):
            raise OmniClientError(f"seed must be an integer, got {self.seed!r}", param="seed")

    def _validate_guidance(self) -> None:
        for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "flow_shift"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < 0):
                raise OmniClientError(f"{name} must be a non-negative number, got {value!r}", param=name)
        if self.boundary_ratio is not None and not 0.0 <= self.boundary_ratio <= 1.0:
            raise OmniClientError(
                f"boundary_ratio must be in [0, 1], got {self.boundary_ratio!r}", param="boundary_ratio"
            )

    def _validate_choices(self) -> None:
        if self.quality is not None and self.quality not in QUALITY_VALUES:
            raise OmniClientError(
                f"quality must be one of {list(QUALITY_VALUES)} or omitted, got {self.quality!r}", param="quality"
            )
        if self.output_type not in ("pil", "np", "pt", "latent"):
            raise OmniClientError(f"output_type must be pil, np, pt or latent, got {self.output_type!r}",
                                  param="output_type")
        if not isinstance(self.extra_args, dict):
            raise OmniClientError("extra_args must be an object", param="extra_args")

    def clone(self) -> OmniDiffusionSamplingParams:
        return copy.deepcopy(self)

    @classmethod
    def from_params(cls, params: Any) -> OmniDiffusionSamplingParams:
        """Accept our params unchanged, or lift vLLM `SamplingParams` (seed + known `extra_args`)."""
        if isinstance(params, cls):
            return params
        if isinstance(params, dict):
            return cls.from_dict(params)
        extra = dict(getattr(params, "extra_args", None) or {})
        known = {f.name for f in fields(cls)} - {"extra_args"}
        kwargs = {k: extra.pop(k) for k in list(extra) if k in known}
        if getattr(params, "seed", None) is not None:
            kwargs.setdefault("seed", params.seed)
        return cls(**kwargs, extra_args=extra)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OmniDiffusionSamplingParams:
        """Build from a JSON-like dict; an unknown key is an error that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OmniClientError(f"unknown diffusion sampling parameter(s): {unknown}", param=unknown[0])
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
