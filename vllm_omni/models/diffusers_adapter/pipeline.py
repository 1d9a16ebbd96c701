"""Runs an unmodified diffusers pipeline, one request at a time, behind the vllm-omni pipeline contract.

Sampling params map onto the keyword arguments the pipeline's `__call__` declares. A parameter the request
sets but the pipeline does not accept is a client error naming it, never silently dropped. With the same
seed the output is pixel-identical to calling diffusers directly. Progress and abort go through diffusers'
public `callback_on_step_end`: an aborted request stops after the step it is in (raised out of the callback,
so nothing more is denoised or decoded).

Outputs: `images` (PIL images), `frames` / `videos` (uint8 frames and fps: the video routes), `audios` (one
waveform and its sample rate: the speech route's and chat's audio encoders). A pipeline whose output is none of
these, or whose audio has no sample rate the adapter can read, is refused when it is loaded.
"""

from __future__ import annotations

import inspect
import secrets
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError, RequestAbortedError
from vllm_omni.inputs.data import knob_names

_OUTPUT_COUNT_PARAMS = ("num_images_per_prompt", "num_videos_per_prompt")
_DEFAULT_FPS = 16
_OUTPUT_FIELDS = ("frames", "videos", "audios", "images")
"""The output dataclass fields the adapter converts, in the order the registry picks the output modality."""
_SAMPLE_RATES = (("vocoder", "sampling_rate"), ("vae", "sampling_rate"), ("unet", "sample_rate"))
"""Where diffusers' audio pipelines keep their output rate (AudioLDM / MusicLDM, Stable Audio, Dance Diffusion)."""


def output_fields(pipe: Any) -> set[str]:
    """The fields of the output dataclasses that the module of the pipeline's class declares (what its
    `__call__` returns, as the registry reads the output modality), else the first of its bases' modules that
    declares any (a subclass defined elsewhere)."""
    import sys

    from diffusers.utils import BaseOutput

    for cls in type(pipe).__mro__:
        fields = {name for value in vars(sys.modules[cls.__module__]).values()
                  if isinstance(value, type) and issubclass(value, BaseOutput) and value is not BaseOutput
                  for name in getattr(value, "__dataclass_fields__", {})}
        if fields:
            return fields
    return set()


def audio_sample_rate(pipe: Any) -> int | None:
    for component, key in _SAMPLE_RATES:
        config = getattr(getattr(pipe, component, None), "config", None)
        if config is not None and config.get(key):
            return int(config[key])
    return None


class DiffusersAdapterPipeline:
    supports_request_batch: ClassVar[bool] = False

    def __init__(self, pipe: Any, od_config: OmniDiffusionConfig) -> None:
        if (od_config.cache_backend or "none") != "none":
            raise ValueError(f"cache_backend={od_config.cache_backend!r}: the generic diffusers adapter has no cache "
                             f"hooks ({type(pipe).__name__}); cache acceleration runs on the native pipelines")
        self.pipe = pipe
        self.od_config = od_config
        self._accepted = set(inspect.signature(pipe.__call__).parameters)
        fields = output_fields(pipe)
        self.output_field = next((name for name in _OUTPUT_FIELDS if name in fields), None)
        """What `__call__`'s output carries that is converted (the output modality)."""
        if self.output_field is None:
            raise ValueError(f"{type(pipe).__name__} returns {sorted(fields) or 'no declared output dataclass'}; "
                             f"the generic diffusers adapter converts {list(_OUTPUT_FIELDS)} only")
        self.sample_rate = audio_sample_rate(pipe) if self.output_field == "audios" else None
        if self.output_field == "audios" and self.sample_rate is None:
            raise ValueError(f"{type(pipe).__name__} makes audio, but the adapter finds its sample rate in none of "
                             f"{[f'{c}.config.{k}' for c, k in _SAMPLE_RATES]}")

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> DiffusersAdapterPipeline:
        from diffusers import DiffusionPipeline

        if od_config.load_format == "dummy":
            from vllm_omni.diffusion.model_loader.dummy import build_diffusers_pipeline

            pipe = build_diffusers_pipeline(model_dir, device, dtype)
        else:
            pipe = DiffusionPipeline.from_pretrained(model_dir, dtype=dtype, **od_config.diffusers_load_kwargs)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=not od_config.enable_progress_bar)
        return cls(pipe, od_config)

    def to(self, device: torch.device) -> None:
        self.pipe.to(device)

    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext) -> list[DiffusionOutput]:
        outputs = []
        for request in batch.requests:
            try:
                if ctx.aborted([request.request_id]):
                    raise RequestAbortedError()
                outputs.append(self._generate(request, ctx))
            except Exception as exc:
                outputs.append(DiffusionOutput.from_exception(exc))
        return outputs

    def call_kwargs(self, request: OmniDiffusionRequest) -> dict[str, Any]:
        """The `__call__` arguments for `request` (the generator is seeded on CPU, like diffusers' docs do)."""
        sp = request.sampling_params
        if sp.quality not in (None, "lossless") or sp.cache_config:
            raise OmniClientError(f"{type(self.pipe).__name__} runs on the generic diffusers adapter, which has no "
                                  "cache acceleration: use quality='lossless' or omit it",
                                  param="quality" if sp.quality not in (None, "lossless") else "cache_config")
        if sp.lora:
            raise OmniClientError(f"{type(self.pipe).__name__} runs on the generic diffusers adapter, which serves no "
                                  "per-request LoRA (the native pipelines do, docs/lora.md)", param="lora")
        for name in ("two_stage", "refine_lora"):
            if getattr(sp, name):
                raise OmniClientError(f"{name}: {type(self.pipe).__name__} has no two-stage variant", param=name)
        kwargs: dict[str, Any] = {"prompt": request.prompt_text}
        if request.negative_prompt is not None:
            kwargs["negative_prompt"] = request.negative_prompt
        for name in knob_names(pipeline_kwarg=True):  # passed to `__call__` under the same name
            if getattr(sp, name) is not None:
                kwargs[name] = getattr(sp, name)
        if sp.num_outputs_per_prompt != 1:
            if self.output_field == "audios":  # an audio answer is one waveform
                raise OmniClientError(f"{type(self.pipe).__name__} answers with one waveform: "
                                      "num_outputs_per_prompt must be 1", status_code=422,
                                      param="num_outputs_per_prompt")
            name = next((n for n in _OUTPUT_COUNT_PARAMS if n in self._accepted), "num_outputs_per_prompt")
            kwargs[name] = sp.num_outputs_per_prompt
        images = request.multi_modal_data.get("image")
        if images is not None:
            kwargs["image"] = images
        kwargs.update(sp.extra_args)
        rejected = sorted(set(kwargs) - self._accepted)
        if rejected:
            raise OmniClientError(
                f"{type(self.pipe).__name__} does not accept {rejected}", status_code=422, param=rejected[0]
            )
        seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        kwargs["generator"] = torch.Generator(device="cpu").manual_seed(seed)
        if "output_type" in self._accepted:
            as_arrays = sp.output_type == "pil" and self.output_field != "images"  # frames / audio: arrays
            kwargs["output_type"] = "np" if as_arrays else sp.output_type
        return kwargs

    def _generate(self, request: OmniDiffusionRequest, ctx: StepContext) -> DiffusionOutput:
        kwargs = self.call_kwargs(request)
        if "callback_on_step_end" in self._accepted:
            kwargs["callback_on_step_end"] = self._step_callback(request.request_id, ctx)
        start = time.perf_counter()
        result = self.pipe(**kwargs)
        output = self._convert(result, request)
        return DiffusionOutput(output=output, stage_durations={"pipeline": time.perf_counter() - start})

    @staticmethod
    def _step_callback(request_id: str, ctx: StepContext) -> Any:
        """diffusers' `callback_on_step_end`: reports the step done, then leaves if the request was aborted."""

        def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            total = getattr(pipe, "num_timesteps", None) or len(pipe.scheduler.timesteps)
            ctx.report_progress(step + 1, total, [request_id])
            if ctx.aborted([request_id]):
                raise RequestAbortedError()
            return callback_kwargs

        return on_step_end

    def _convert(self, result: Any, request: OmniDiffusionRequest) -> Any:
        if self.output_field == "audios":
            audio = result.audios
            audio = audio.detach().float().cpu().numpy() if hasattr(audio, "detach") else np.asarray(audio)
            return {"audio": audio[0], "sample_rate": self.sample_rate}  # (samples,) or (channels, samples)
        if self.output_field in ("frames", "videos"):
            frames = getattr(result, self.output_field)
            if isinstance(frames, np.ndarray) and frames.dtype != np.uint8:
                frames = (frames * 255).round().clip(0, 255).astype(np.uint8)
            if isinstance(frames, np.ndarray) and frames.ndim == 5 and frames.shape[0] == 1:
                frames = frames[0]
            return {"video": frames, "fps": request.sampling_params.fps or _DEFAULT_FPS}
        images = result.images
        return list(images) if isinstance(images, list) else images
