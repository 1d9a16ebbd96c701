"""Per-stage sampling parameters for diffusion stages.

AR stages take vLLM's own `SamplingParams`; diffusion stages take `OmniDiffusionSamplingParams`, the one schema
of diffusion knobs: its field metadata says which knobs the HTTP routes accept, which ones split request batches
and what range each takes, so the protocol models, the multipart coercion, the batching key and the validation
messages are all derived from it (adding a knob is one field here plus its consumer in the pipeline).
Invalid values fail at construction with an `OmniClientError` naming the field, so a bad request never
reaches a worker.
"""

from __future__ import annotations

import copy
import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.cache_config import check_request_cache_config
from vllm_omni.inputs.lora import parse_lora, parse_refine_lora

Quality = Literal["lossless", "high", "fast"]
OutputType = Literal["pil", "np", "pt", "latent"]
QUALITY_VALUES: tuple[str, ...] = ("lossless", "high", "fast")
OUTPUT_TYPES: tuple[str, ...] = ("pil", "np", "pt", "latent")
MAX_OUTPUTS_PER_PROMPT = 16
MAX_IMAGE_SIDE = 8192
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What `torch.Generator.manual_seed` and msgspec both accept."""
PRIORITY_RANGE = (-(2**63), 2**63 - 1)
"""vLLM's bounds of `priority`."""
MAX_DEADLINE_MS = 24 * 3600 * 1000.0
"""A day: a longer deadline is no deadline at all, and the bound keeps the arithmetic finite."""


def knob(default: Any = None, *, http: bool = True, batch_key: bool = True, minimum: float | None = None,
         maximum: float | None = None, choices: tuple[str, ...] | None = None, pipeline_kwarg: bool = False) -> Any:
    """A schema field. `http`: an extra-body field of the diffusion routes; `batch_key`: requests differing in it
    never share a forward; `minimum`/`maximum`/`choices`: the accepted values; `pipeline_kwarg`: passed under
    the same name to a diffusers pipeline's `__call__` by the generic adapter."""
    metadata = {"http": http, "batch_key": batch_key, "minimum": minimum, "maximum": maximum, "choices": choices,
                "pipeline_kwarg": pipeline_kwarg}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DiffusionLimits:
    """Server-configurable maxima (`--max-inference-steps`, `--max-num-frames`, `--max-output-pixels`): the
    schema's own ranges only exclude nonsense, these protect a shared server from one request's cost."""

    max_inference_steps: int = 1000
    max_num_frames: int = 1025
    max_output_pixels: int = 2048 * 2048


@dataclass
class OmniDiffusionSamplingParams:
    """What a diffusion request asks for. `None` means "the pipeline's default"."""

    height: int | None = knob(minimum=8, maximum=MAX_IMAGE_SIDE, pipeline_kwarg=True)
    width: int | None = knob(minimum=8, maximum=MAX_IMAGE_SIDE, pipeline_kwarg=True)
    num_inference_steps: int | None = knob(minimum=1, pipeline_kwarg=True)
    guidance_scale: float | None = knob(minimum=0, pipeline_kwarg=True)
    """Distilled guidance (FLUX) or classic CFG (Wan); Qwen-Image uses `true_cfg_scale`."""
    guidance_scale_2: float | None = knob(minimum=0, pipeline_kwarg=True)
    """Wan2.2 low-noise expert guidance."""
    true_cfg_scale: float | None = knob(minimum=0, pipeline_kwarg=True)
    """Classifier-free guidance with a negative prompt; CFG runs when > 1 and a negative prompt exists."""
    negative_prompt: str | None = knob(batch_key=False)
    """Only its presence is in the batching key (the text is per row)."""
    seed: int | None = knob(batch_key=False, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    num_outputs_per_prompt: int = knob(1, minimum=1, maximum=MAX_OUTPUTS_PER_PROMPT)
    quality: Quality | None = knob(choices=QUALITY_VALUES)
    """`lossless`: nothing cached (bitwise the uncached path); `high` / `fast`: the model family's cache presets
    (docs/cache.md); None: the server's `--cache-backend` / `--cache-config`."""
    cache_config: dict[str, Any] | None = knob()
    """A request's own cache settings over its quality's preset (keys in docs/cache.md; unknown keys are refused
    naming them)."""
    output_type: OutputType = knob("pil", http=False, choices=OUTPUT_TYPES)
    num_frames: int | None = knob(minimum=1, pipeline_kwarg=True)
    fps: int | None = knob(minimum=1, maximum=240)
    boundary_ratio: float | None = knob(minimum=0, maximum=1, pipeline_kwarg=True)
    flow_shift: float | None = knob(minimum=0, pipeline_kwarg=True)
    two_stage: bool | None = knob()
    """LTX-2's two-stage generation (diffusers' "Two-stages Generation", LTX-2's `ti2vid_two_stages`): a base pass
    at half the requested height and width, the checkpoint's x2 latent upsampler, then a short refine pass at full
    size. None/False: one stage. A pipeline without such a variant refuses true (400 naming the field)."""
    refine_lora: dict[str, Any] | None = knob(batch_key=False)
    """The adapter of the two-stage refine pass, {"name" or "path", "scale"} as one entry of `lora` (None: the
    checkpoint's distilled LoRA, as diffusers' recipe loads it; docs/video.md). Not part of the batching key, as
    `lora`."""
    max_sequence_length: int | None = knob(http=False, minimum=1, maximum=65536, pipeline_kwarg=True)
    lora: dict[str, Any] | list[dict[str, Any]] | None = knob(batch_key=False)
    """Adapters to run with (`vllm_omni/inputs/lora.py`, docs/lora.md): {"name" or "path", "scale"} or a list of
    them. Not part of the batching key: requests with different adapters share one transformer forward."""
    priority: int = knob(0, batch_key=False, minimum=PRIORITY_RANGE[0], maximum=PRIORITY_RANGE[1])
    """vLLM's priority semantics: lower values are served first, ties by arrival (`--diffusion-scheduler-policy
    priority`; the other policies ignore it)."""
    deadline_ms: float | None = knob(batch_key=False, minimum=1, maximum=MAX_DEADLINE_MS)
    """Milliseconds after arrival by which the request should be done; the `slo` policy serves earliest
    deadlines first (None = the server's `--default-deadline-ms`)."""
    partial_images: int = knob(0, http=False, batch_key=False, minimum=0, maximum=3)
    """Decoded previews sent before the final image, at evenly spaced steps (`/v1/images/generations` with
    `stream=true`)."""
    stream_partial_outputs: bool = knob(False, http=False, batch_key=False)
    """Stream denoise progress and decoded video chunks as unfinished outputs before the final one (AsyncOmni).
    Not part of the batching key: streaming and non-streaming requests share forwards."""
    stream_video_chunks: bool = knob(True, http=False, batch_key=False)
    """With `stream_partial_outputs`, whether decoded video chunks stream too. False: progress only, and the final
    output carries the whole clip (the `/v1/videos` job route, which encodes one MP4, needs no chunks to join)."""
    extra_args: dict[str, Any] = knob({}, http=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("lora", "refine_lora"):  # adapter objects: checked by their parsers
                _check_value(f.name, getattr(self, f.name), f.metadata)
        parse_lora(self.lora)
        parse_refine_lora(self.refine_lora)
        if self.cache_config is not None:
            check_request_cache_config(self.cache_config, self.quality, self.num_inference_steps)

    def check_limits(self, limits: DiffusionLimits, prefix: str = "") -> None:
        """The server's maxima; `prefix` locates the params in the request (e.g. `sampling_params_list[0].`)."""
        for name, flag, maximum in (("num_inference_steps", "--max-inference-steps", limits.max_inference_steps),
                                    ("num_frames", "--max-num-frames", limits.max_num_frames)):
            value = getattr(self, name)
            if value is not None and value > maximum:
                raise OmniClientError(f"{prefix}{name}={value} is more than this server allows ({maximum}; see "
                                      f"{flag})", param=prefix + name)
        if self.width is not None and self.height is not None and \
                self.width * self.height > limits.max_output_pixels:
            raise OmniClientError(f"{prefix}width x height = {self.width * self.height} pixels is more than this "
                                  f"server allows ({limits.max_output_pixels}; see --max-output-pixels)",
                                  param=prefix + "width")

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


def knob_names(**flags: bool) -> tuple[str, ...]:
    """Schema fields whose metadata has every given flag, e.g. `knob_names(http=True)`."""
    return tuple(f.name for f in fields(OmniDiffusionSamplingParams)
                 if all(f.metadata.get(k) == v for k, v in flags.items()))


def knob_type(name: str) -> type:
    """The scalar type of a knob: int, float, str, bool or dict (Literal choices are str)."""
    return _knob_types()[name]


def knob_range(name: str) -> tuple[float | None, float | None]:
    meta = next(f.metadata for f in fields(OmniDiffusionSamplingParams) if f.name == name)
    return meta["minimum"], meta["maximum"]


@functools.cache
def _knob_types() -> dict[str, type]:
    out = {}
    for name, hint in typing.get_type_hints(OmniDiffusionSamplingParams).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
            types.UnionType, typing.Union) else [hint]
        base = args[0]
        out[name] = str if typing.get_origin(base) is Literal else typing.get_origin(base) or base
    return out


def _check_value(name: str, value: Any, meta: Any) -> None:
    if value is None:
        return
    kind = knob_type(name)
    if kind is int and not _is_int(value):
        raise OmniClientError(f"{name} must be an integer, got {value!r}", param=name)
    if kind is float and (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)):
        raise OmniClientError(f"{name} must be a finite number, got {value!r}", param=name)
    if kind in (dict, str, bool) and not isinstance(value, kind):
        raise OmniClientError(f"{name} must be {'an object' if kind is dict else f'a {kind.__name__}'}, "
                              f"got {value!r}", param=name)
    if meta["choices"] is not None and value not in meta["choices"]:
        raise OmniClientError(f"{name} must be one of {list(meta['choices'])} or omitted, got {value!r}", param=name)
    low, high = meta["minimum"], meta["maximum"]
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise OmniClientError(f"{name} must be {bounds}, got {value!r}", param=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
