"""Which output shapes a diffusion pipeline can make, and what one request costs in memory at its shape,
known from the checkpoint's config files alone.

A family's `DiffusionPipelineEntry.shape_rule` names a function that reads the checkpoint's JSON configs (no
torch, no weights) and returns a `ShapeRule`. The API process asks it through `ModelCapabilities`, so a size
the pipeline would refuse is a 400 on every route before anything is queued (a `/v1/videos` job used to be
`queued`, then `failed`), and the pipeline's own check in the worker stays as the last line.

The engine sets `memory_budget_bytes` (what the stage has free); a request whose `estimate_bytes` exceeds it
can never run and is a 400 naming the field that makes it too big, and the engine's scheduler admits a request
only while the estimates of what runs plus its own fit (it waits otherwise). On CUDA the warm-up measures one
request's peak at each warm-up size, and the estimate at those sizes is that measurement (`measured_peaks`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_omni.catalog.spec import import_target
from vllm_omni.errors import OmniClientError

ACTIVATION_FACTOR = 16
"""Live activation elements per token and hidden unit in one transformer block's forward: q, k, v, the
attention output and its projection (5), the MLP's 4x-wide intermediate and its activation (8), the residual
and the modulated / normed copies (3). Attention scores are not counted: every backend we run is
memory-efficient (flash / SDPA kernels), not the T^2 math path."""
LATENT_COPIES = 4
"""Latent-sized fp32 tensors alive during a step: latents, the noise prediction, the scheduler's state."""
VAE_FACTOR = 4
"""Live full-resolution feature maps of the VAE decoder's last up-block, in units of its channel count."""


@dataclass(frozen=True)
class ShapeRule:
    size_multiple: int = 1
    """Height and width must be multiples of this (VAE downsampling x transformer patch); others are refused."""
    min_size: int = 1
    """Smallest height / width that leaves at least one latent patch."""
    half_size_knob: str | None = None
    """A boolean sampling knob under which the pipeline also makes the image at half the size (LTX-2's
    `two_stage`: its base pass), so that height and width are multiples of twice `size_multiple` then."""
    frame_stride: int | None = None
    """Video pipelines: the VAE packs 1 + k * frame_stride frames (another count is rounded, as in diffusers);
    None for image pipelines."""
    # What one request costs (`estimate_bytes`), from the same configs:
    token_stride: int = 16
    """Output pixels per transformer token side (VAE spatial factor x patch size)."""
    vae_spatial: int = 8
    hidden_size: int = 0
    """The transformer's width (heads x head dim); 0: no estimate."""
    latent_channels: int = 16
    vae_channels: int = 128
    """Channels of the VAE decoder at full resolution."""
    text_tokens: int = 512
    """Prompt tokens the transformer attends to besides the image tokens (the text encoder's maximum)."""
    step_table_width: int = 0
    """Elements per step, row and hidden unit of the tables a pipeline precomputes for all steps (adaLN
    modulation: 12 x layers for Qwen-Image)."""
    default_size: tuple[int, int] = (1024, 1024)
    """(height, width) the pipeline makes when the request gives none."""
    default_frames: int = 1
    default_steps: int = 50
    min_steps: int = 1
    """Fewest denoise steps the scheduler makes a schedule of (`scheduler_min_steps`)."""
    dtype_bytes: int = 4
    """Bytes per activation element (set by the engine from its dtype)."""
    memory_budget_bytes: int | None = None
    """What the stage has free for requests (set by the engine); None: no memory admission."""
    measured_peaks: tuple[tuple[int, int, int], ...] = ()
    """(height, width, bytes): the peak one request at that size took beyond what its worker held before it,
    measured at warm-up (CUDA; set by the engine): a default request with a negative prompt (CFG on wherever
    the family's default guidance runs it) of `measured_steps` steps."""
    measured_steps: int = 2

    def check(self, sp: Any, prefix: str = "", size_field: str | None = None) -> None:
        """Refuse a height / width the pipeline cannot make. `size_field` names the request field the two came
        from ("size") when the client gave them that way."""
        halves = bool(self.half_size_knob and getattr(sp, self.half_size_knob))
        multiple, min_size = self.size_multiple, self.min_size
        if halves:
            multiple, min_size = 2 * multiple, 2 * min_size
        why = f" with {self.half_size_knob} (it also makes half the size)" if halves else ""
        for name in ("width", "height"):
            value = getattr(sp, name)
            if value is None:
                continue
            param = prefix + (size_field or name)
            if value < min_size:
                raise OmniClientError(f"{name}={value} is smaller than this model makes{why} ({min_size})",
                                      param=param)
            if value % multiple:
                raise OmniClientError(f"{name} must be a multiple of {multiple} for this model{why}, got {value}",
                                      param=param)
        steps = sp.num_inference_steps
        if steps is not None and steps < self.min_steps:
            raise OmniClientError(f"num_inference_steps={steps} is fewer than this model's scheduler makes a schedule "
                                  f"of ({self.min_steps}: with one step its shift_terminal stretch divides 0 by 0)",
                                  param=prefix + "num_inference_steps")
        self.check_memory(sp, prefix, size_field)

    def estimate_bytes(self, sp: Any) -> int:
        """Peak memory of one request at its shape beyond the weights. At a size warm-up measured, with the
        default frames and guidance: that measurement per output, plus what the model below adds for its other
        step count (the per-step tables). Elsewhere the model alone (`modelled_bytes`)."""
        height, width = sp.height or self.default_size[0], sp.width or self.default_size[1]
        peak = next((b for h, w, b in self.measured_peaks if (h, w) == (height, width)), None)
        if peak is None or sp.guidance_scale is not None or sp.true_cfg_scale is not None or (
                self.frame_stride and sp.num_frames not in (None, self.default_frames)):
            return self.modelled_bytes(sp)
        one = replace(sp, num_outputs_per_prompt=1)
        steps = self.modelled_bytes(one) - self.modelled_bytes(replace(one, num_inference_steps=self.measured_steps))
        return sp.num_outputs_per_prompt * (peak + steps)

    def modelled_bytes(self, sp: Any) -> int:
        """The model of one request's peak: transformer activations (tokens x hidden x ACTIVATION_FACTOR, CFG rows
        counted), latents, the per-step tables and the VAE decode / output frames. An upper bound of the right
        order, not a measurement."""
        if not self.hidden_size:
            return 0
        height, width = sp.height or self.default_size[0], sp.width or self.default_size[1]
        outputs = sp.num_outputs_per_prompt
        rows = 2 * outputs  # a CFG pass doubles the rows; counted always (an upper bound)
        frames = (sp.num_frames or self.default_frames) if self.frame_stride else 1
        latent_frames = (frames - 1) // self.frame_stride + 1 if self.frame_stride else 1
        tokens = latent_frames * (height // self.token_stride) * (width // self.token_stride) + self.text_tokens
        latent_pixels = latent_frames * (height // self.vae_spatial) * (width // self.vae_spatial)
        steps = sp.num_inference_steps or self.default_steps
        activations = rows * tokens * self.hidden_size * ACTIVATION_FACTOR * self.dtype_bytes
        latents = rows * self.latent_channels * latent_pixels * 4 * LATENT_COPIES
        tables = steps * rows * self.step_table_width * self.hidden_size * self.dtype_bytes
        decode_frames = self.frame_stride or 1  # video VAEs decode one latent frame at a time
        decode = outputs * decode_frames * height * width * self.vae_channels * VAE_FACTOR * self.dtype_bytes
        frames_out = outputs * frames * height * width * 3 * 4
        return activations + latents + tables + decode + frames_out

    def check_memory(self, sp: Any, prefix: str = "", size_field: str | None = None) -> None:
        """A request that could not run even alone is a 400 naming the field that makes it too big: the first of
        num_outputs_per_prompt, num_frames, num_inference_steps that fits when reduced to 1, else the size."""
        budget = self.memory_budget_bytes
        if budget is None or (need := self.estimate_bytes(sp)) <= budget:
            return
        param = size_field or "width"
        for name in ("num_outputs_per_prompt", "num_frames", "num_inference_steps"):
            if getattr(sp, name) not in (None, 1) and self.estimate_bytes(replace(sp, **{name: 1})) <= budget:
                param = name
                break
        raise OmniClientError(f"this request needs about {need / 2**30:.2f} GiB at its shape, more than the "
                              f"{budget / 2**30:.2f} GiB this diffusion stage has for requests (see "
                              f"--diffusion-memory-budget-gb); reduce {param}", param=prefix + param)


def load_shape_rule(target: str, model_dir: Path) -> ShapeRule:
    """The family's rule (`DiffusionPipelineEntry.shape_rule`, "module:function") with its scheduler's floor on
    the step count."""
    return replace(import_target(target)(model_dir), min_steps=scheduler_min_steps(model_dir))


def scheduler_min_steps(model_dir: Path) -> int:
    """2 where the scheduler stretches its schedule to end at `shift_terminal` (diffusers'
    `FlowMatchEulerDiscreteScheduler`: Qwen-Image, LTX-2): one step's only sigma is 1, and the stretch divides
    1 - 1 by 1 - 1, so diffusers makes a NaN image of it. Else 1."""
    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return 2 if config.get("shift_terminal") else 1


def read_config(model_dir: Path, subfolder: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / subfolder / "config.json").read_text())
