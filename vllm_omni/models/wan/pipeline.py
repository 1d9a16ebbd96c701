"""Wan 2.1 / 2.2 text-to-video, natively: UMT5 text encoder, our Wan DiT (one or two experts), UniPC, Wan VAE.

Reference spec: diffusers `WanPipeline.__call__`. The hooks of `NativeDiffusionPipeline` follow it so that, with
the same weights and seed, the decoded frames match:
  1. resolve sizes (height/width multiples of 16, `num_frames` rounded to 4k+1),
  2. encode prompt and negative prompt (zero-padded to `max_sequence_length`),
  3. draw noise per request with `torch.Generator("cpu").manual_seed(seed)`, shape (n_outputs, 16, T, h, w),
  4. denoise with true CFG (positive and negative rows in one DiT forward); Wan2.2 A14B switches from the
     high-noise `transformer` to the low-noise `transformer_2` once t < boundary_ratio * 1000, with
     `guidance_scale_2`,
  5. un-normalize latents and decode them with the causal VAE, chunk by chunk (streamed to listeners; an aborted
     request leaves between chunks).
Requests whose sampling-params keys agree (the scheduler guarantees it) share every forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from torch import nn

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.distributed.vae_patch import vae_patch_group
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.diffusion.timing import elapsed_since, synchronized_now
from vllm_omni.diffusion.video_utils import STREAMED_FRAMES, to_uint8_frames
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger
from vllm_omni.models.wan.cache import presets_for
from vllm_omni.models.wan.vae_stream import WanVaeStream

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.models.wan.transformer import WanTransformer3DModel

logger = init_logger(__name__)

DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES = 480, 832, 81
DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 5.0
DEFAULT_FPS = 16
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class WanGeometry:
    height: int
    width: int
    num_frames: int
    latent_frames: int
    latent_height: int
    latent_width: int


@dataclass
class WanConditioning(Conditioning):
    """What the DiT rows of one group are conditioned on besides latents and timestep."""

    geometry: WanGeometry
    embeds: torch.Tensor
    """UMT5 text tokens: one row per latent row, then (CFG) the negatives in the same order."""
    cfg: CFG | None
    """Its scale is the guidance of `transformer` (and of every step without a boundary)."""
    guidance_2: float
    """Guidance of `transformer_2` (Wan2.2 A14B, steps below the boundary)."""
    boundary: float | None
    """Timestep below which `transformer_2` denoises; None: one expert."""
    latents: torch.Tensor | None = None
    """Per latent row (image-conditioned pipelines): I2V's 4 mask + 16 image-latent channels concatenated to the
    noisy latents, or TI2V's latents of the given first frame."""
    image_embeds: torch.Tensor | None = None
    """CLIP tokens per latent row for the DiT's image cross-attention branch (Wan2.1 I2V)."""
    first_frame_mask: torch.Tensor | None = None
    """Wan2.2 TI2V: (1, 1, T, h, w), 0 on the given first frame (whose latents are `latents`), 1 elsewhere; the
    DiT sees the first frame's latents there and a timestep of 0 on its tokens."""
    high_noise_steps: list[bool] | None = None
    """Per step: whether `transformer` (True) or `transformer_2` denoises it (host copy, read without a sync)."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> WanConditioning:
        """The conditioning of latent rows `rows` only (and of their negatives)."""
        return replace(self, embeds=self.embeds.index_select(0, text_rows),
                       latents=None if self.latents is None else self.latents.index_select(0, rows),
                       image_embeds=None if self.image_embeds is None else self.image_embeds.index_select(0, rows))


@dataclass
class WanStepInput:
    """One state's DiT rows at its step (`WanPipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    timestep: torch.Tensor = rows()
    """(rows,), or (rows, tokens) for Wan2.2 TI2V."""
    embeds: torch.Tensor = rows(text=True)
    image_embeds: torch.Tensor | None = rows()
    high_noise: bool
    """Which expert runs the step: `transformer` (else Wan2.2 A14B's `transformer_2`); co-batched states share
    it (`step_group_key`)."""


class WanPipeline(NativeDiffusionPipeline):
    """Text-to-video for Wan2.1 (one DiT) and Wan2.2 A14B (high/low-noise expert pair)."""

    progress_desc: ClassVar[str] = "Wan denoise"
    lora_loader: ClassVar[str | None] = "WanLoraLoaderMixin"

    def __init__(self, *, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, tokenizer: Any,
                 text_encoder: nn.Module, transformer: WanTransformer3DModel,
                 transformer_2: WanTransformer3DModel | None, vae: AutoencoderKLWan, scheduler_config: dict[str, Any],
                 boundary_ratio: float | None, expand_timesteps: bool = False) -> None:
        super().__init__()
        self.od_config = od_config
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.boundary_ratio = boundary_ratio
        # Wan2.2 TI2V: one timestep per latent token (so the tokens of a given first frame can stay clean).
        self.expand_timesteps = expand_timesteps
        self.vae_scale_temporal = vae.config.scale_factor_temporal
        self.vae_scale_spatial = vae.config.scale_factor_spatial

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                        dtype: torch.dtype) -> Self:
        import json

        model_dir = Path(model_dir)
        index = json.loads((model_dir / "model_index.json").read_text())
        components = cls._load_components(od_config, model_dir, index, device, dtype)
        logger.info("Loaded %s from %s (%s, %s)", cls.__name__, model_dir, device, dtype)
        return cls(od_config=od_config, device=device, dtype=dtype, **components)

    @classmethod
    def _load_components(cls, od_config: OmniDiffusionConfig, model_dir: Path, index: dict[str, Any],
                         device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        import json

        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        from vllm_omni.diffusion.model_loader.components import load_native_transformer
        from vllm_omni.diffusion.model_loader.dummy import load_pretrained
        from vllm_omni.models.wan.transformer import WanTransformer3DModel

        def load_dit(subfolder: str) -> WanTransformer3DModel:
            # Compiled blocks only: at video lengths the forward is GPU-bound, a CUDA graph adds nothing
            # (H200, Wan2.1 1.3B, 33 frames: CFG step 425.6 ms eager, 276.0 compiled, 275.7 as a graph).
            return load_native_transformer(WanTransformer3DModel, model_dir, subfolder, od_config, device, dtype,
                                           cuda_graphs=False)

        load_format = od_config.load_format
        has_second = index.get("transformer_2") is not None and (model_dir / "transformer_2").is_dir()
        return dict(
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
            text_encoder=load_pretrained(UMT5EncoderModel, model_dir / "text_encoder", device=device, dtype=dtype,
                                         load_format=load_format),
            transformer=load_dit("transformer"),
            transformer_2=load_dit("transformer_2") if has_second else None,
            # The VAE stays fp32 (as the Wan-AI examples load it): decode quality is sensitive, its cost is small.
            vae=load_pretrained(AutoencoderKLWan, model_dir / "vae", device=device, dtype=torch.float32,
                                load_format=load_format),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            boundary_ratio=index.get("boundary_ratio"),
            expand_timesteps=bool(index.get("expand_timesteps")),
        )

    def cache_presets(self) -> FamilyPresets:
        return presets_for(self.transformer)

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates the request; requests with equal keys run in one forward."""
        self.validate_request(request)
        sp = request.sampling_params
        return (sp.height, sp.width, sp.num_frames, sp.num_inference_steps, sp.guidance_scale, sp.guidance_scale_2,
                sp.boundary_ratio, sp.flow_shift, sp.num_outputs_per_prompt, sp.max_sequence_length, sp.fps)

    def validate_request(self, request: OmniDiffusionRequest) -> None:
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> WanConditioning:
        """Validates the group's sizes and guidance, then encodes prompts (and negatives for CFG) in one batch."""
        sp = requests[0].sampling_params
        geometry = self.resolve_geometry(sp)
        guidance, guidance_2, boundary = self.resolve_guidance(sp)
        cfg = CFG(guidance) if guidance > 1.0 else None  # diffusers decides CFG on the first expert's scale only
        max_len = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        texts = [text for text, _ in prompt_rows(requests, cfg)]
        embeds = self.encode_texts(texts, max_len).repeat_interleave(sp.num_outputs_per_prompt, dim=0)
        return WanConditioning(geometry, embeds, cfg, guidance_2, boundary)

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: WanConditioning) -> torch.Tensor:
        """Noise per request from its own CPU generator, the same draw diffusers makes for that seed."""
        geometry = conditioning.geometry
        shape = (requests[0].sampling_params.num_outputs_per_prompt, self.vae.config.z_dim, geometry.latent_frames,
                 geometry.latent_height, geometry.latent_width)
        noise = []
        for request in requests:
            seed = request.sampling_params.seed
            generator = torch.Generator(device="cpu").manual_seed(shared_random_seed() if seed is None else seed)
            noise.append(torch.randn(shape, generator=generator, dtype=torch.float32))
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        import diffusers

        sp = requests[0].sampling_params
        cls = getattr(diffusers, self.scheduler_config["_class_name"])
        overrides = {} if sp.flow_shift is None else {"flow_shift": float(sp.flow_shift)}
        scheduler = cls.from_config(self.scheduler_config, **overrides)
        scheduler.set_timesteps(sp.num_inference_steps or DEFAULT_NUM_INFERENCE_STEPS, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare_step_tables(self, state: DenoiseState) -> None:
        cond = state.conditioning
        steps = len(state.timesteps)
        cond.high_noise_steps = [True] * steps if cond.boundary is None else (state.timesteps >= cond.boundary).tolist()

    @staticmethod
    def high_noise(state: DenoiseState) -> bool:
        """Whether this state's step belongs to `transformer` (else Wan2.2 A14B's low-noise `transformer_2`)."""
        return state.conditioning.high_noise_steps[state.step_index]

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same DiT input shape, text length, image branch, expert at this step and dtype; prompts, seeds,
        guidance, CFG on/off and step counts may differ."""
        cond = state.conditioning
        return (tuple(self.model_input(state.latents, cond).shape[1:]), cond.embeds.shape[1],
                cond.image_embeds is not None, self.high_noise(state), state.latents.dtype)

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        frames, height, width = state.latents.shape[2:]
        p_t, p_h, p_w = self.transformer.config.patch_size
        image = 0 if cond.image_embeds is None else cond.image_embeds.shape[1]
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        return self.transformer_rows(state) * (tokens + cond.embeds.shape[1] + image)

    def step_inputs(self, state: DenoiseState) -> WanStepInput:
        """The latent rows for the expert that owns this state's timestep."""
        cond = state.conditioning
        t = state.timesteps[state.step_index]
        x = self.model_input(state.latents, cond)
        return WanStepInput(x.to(self.dtype), self.model_timestep(t, x, cond), cond.embeds, cond.image_embeds,
                            self.high_noise(state))

    def transformer_forward(self, inp: WanStepInput, call: Callable[..., Any]) -> torch.Tensor:
        """The rows through the expert that owns their timestep, each row with its own timestep(s)."""
        return call("transformer" if inp.high_noise else "transformer_2", inp.x, inp.timestep, inp.embeds,
                    inp.image_embeds)

    def cfg_scale(self, state: DenoiseState) -> float:
        """Each expert with its own scale (Wan2.2 A14B's `guidance_scale_2` below the boundary)."""
        return super().cfg_scale(state) if self.high_noise(state) else state.conditioning.guidance_2

    def finish(self, state: DenoiseState, ctx: StepContext) -> list[DiffusionOutput]:
        """Decode chunk by chunk; a streamed request's final output carries no frames (they went as chunks)."""
        cond = state.conditioning
        fps = state.requests[0].sampling_params.fps or DEFAULT_FPS
        streamed = {r.request_id for r in state.requests
                    if r.sampling_params.stream_partial_outputs and r.sampling_params.stream_video_chunks} \
            if ctx.partials_enabled else set()
        latents = self.model_input(state.latents, cond) if cond.first_frame_mask is not None else state.latents
        start = synchronized_now(self.device)  # step mode: the last steps may still be queued
        frames = self.decode_chunks(state, latents, ctx, streamed, fps)
        state.durations["vae_decode"] = elapsed_since(start, self.device)
        per = state.outputs_per_request
        outputs = []
        for i, request in enumerate(state.requests):
            if request.request_id in streamed:  # the frames went out as chunks; a caller joins them
                output = {STREAMED_FRAMES: cond.geometry.num_frames, "fps": fps}
            else:
                video = frames[i * per:(i + 1) * per]
                output = {"video": video[0] if per == 1 else video, "fps": fps}
            outputs.append(DiffusionOutput(output=output, stage_durations=dict(state.durations),
                                           extra=self.output_extra(state)))
        return outputs

    # ---- stages --------------------------------------------------------------------------------------------

    def resolve_geometry(self, sp: OmniDiffusionSamplingParams) -> WanGeometry:
        height = sp.height or DEFAULT_HEIGHT
        width = sp.width or DEFAULT_WIDTH
        multiple = self.vae_scale_spatial * self.transformer.config.patch_size[1]
        for name, value in (("height", height), ("width", width)):
            if value % multiple:
                raise OmniClientError(f"{name} must be a multiple of {multiple} for Wan, got {value}", param=name)
        num_frames = sp.num_frames or DEFAULT_NUM_FRAMES
        if num_frames % self.vae_scale_temporal != 1:
            rounded = max(num_frames // self.vae_scale_temporal * self.vae_scale_temporal + 1, 1)
            logger.warning("num_frames=%d is not 4k+1; using %d (as diffusers does)", num_frames, rounded)
            num_frames = rounded
        return WanGeometry(height, width, num_frames, (num_frames - 1) // self.vae_scale_temporal + 1,
                           height // self.vae_scale_spatial, width // self.vae_scale_spatial)

    def resolve_guidance(self, sp: OmniDiffusionSamplingParams) -> tuple[float, float, float | None]:
        """(guidance for `transformer`, guidance for `transformer_2`, boundary timestep or None)."""
        guidance = DEFAULT_GUIDANCE_SCALE if sp.guidance_scale is None else float(sp.guidance_scale)
        boundary_ratio = self.boundary_ratio if sp.boundary_ratio is None else sp.boundary_ratio
        if self.transformer_2 is None or boundary_ratio is None:
            if sp.guidance_scale_2 is not None:
                raise OmniClientError("guidance_scale_2 needs a two-expert model (Wan2.2 A14B with boundary_ratio)",
                                      param="guidance_scale_2")
            return guidance, guidance, None
        guidance_2 = guidance if sp.guidance_scale_2 is None else float(sp.guidance_scale_2)
        num_train = self.scheduler_config.get("num_train_timesteps", 1000)
        return guidance, guidance_2, boundary_ratio * num_train

    def encode_texts(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """UMT5 last hidden states, cut at each prompt's length and zero-padded back (as the model was trained)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask).last_hidden_state.to(self.dtype)
        keep = torch.arange(max_sequence_length, device=self.device)[None, :] < mask.sum(dim=1, keepdim=True)
        return hidden * keep[..., None].to(hidden.dtype)

    @staticmethod
    def model_input(latents: torch.Tensor, cond: WanConditioning) -> torch.Tensor:
        if cond.first_frame_mask is not None:  # TI2V: the given first frame replaces the noisy one
            mask = cond.first_frame_mask
            return (1 - mask) * cond.latents + mask * latents
        if cond.latents is not None:  # Wan2.1 I2V: conditioning channels ride along
            return torch.cat([latents, cond.latents], dim=1)
        return latents

    def model_timestep(self, t: torch.Tensor, x: torch.Tensor, cond: WanConditioning) -> torch.Tensor:
        """(rows,), or (rows, tokens) for Wan2.2 TI2V, where first-frame tokens of an I2V request get 0."""
        if not self.expand_timesteps:
            return t.expand(x.shape[0])
        _, p_h, p_w = self.transformer.config.patch_size
        mask = cond.first_frame_mask
        if mask is None:
            mask = torch.ones(1, 1, *x.shape[2:], device=x.device)
        return (mask[0, 0, :, ::p_h, ::p_w] * t).flatten().unsqueeze(0).expand(x.shape[0], -1)

    def normalize_latents(self, latents: torch.Tensor, *, inverse: bool) -> torch.Tensor:
        """Map between the DiT's normalized latent space and the VAE's (per-channel mean / std of the VAE)."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean if inverse else (latents - mean) * inv_std

    def decode_chunks(self, state: DenoiseState, latents: torch.Tensor, ctx: StepContext, streamed: set[str],
                      fps: int) -> Any:
        """Latents -> uint8 frames (rows, T, H, W, 3) of the requests still in `state`, through the causal VAE
        (None when every request streams: nobody needs the whole clip back).

        Each decoded chunk goes at once to the listeners of the `streamed` requests (their rows, shaped like the
        final output), so clients see the first frames early. Between chunks, aborted requests leave: their rows
        are dropped from `state`, from the frames so far and from the VAE's running cache.
        """
        per = state.outputs_per_request
        keep_clip = any(r.request_id not in streamed for r in state.requests)
        chunks, frame_start = [], 0
        with WanVaeStream(self.vae, self.normalize_latents(latents.to(self.vae.dtype), inverse=True),
                          group=vae_patch_group()) as stream:
            for chunk in stream:
                if keep_clip:
                    chunks.append(chunk)
                if streamed:
                    self.emit_chunk(state, ctx, chunk, streamed, frame_start, fps)
                frame_start += chunk.shape[2]
                aborted = set(ctx.aborted(state.request_ids))
                if aborted:
                    keep = [i for i, r in enumerate(state.requests) if r.request_id not in aborted]
                    rows = torch.tensor([i * per + j for i in keep for j in range(per)], device=chunk.device)
                    state.drop(aborted)
                    if not state.requests:
                        return None
                    stream.keep_rows(rows)
                    chunks = [c.index_select(0, rows) for c in chunks]
        return to_uint8_frames(torch.cat(chunks, dim=2)) if chunks else None

    @staticmethod
    def emit_chunk(state: DenoiseState, ctx: StepContext, chunk: torch.Tensor, streamed: set[str], frame_start: int,
                   fps: int) -> None:
        """One decoded chunk to each streamed request's listener, shaped like that request's final video."""
        per = state.outputs_per_request
        frames = to_uint8_frames(chunk)
        for i, request in enumerate(state.requests):
            if request.request_id in streamed:
                video = frames[i * per:(i + 1) * per]
                ctx.emit_partial(request.request_id, "video_chunk",
                                 {"video": video[0] if per == 1 else video, "fps": fps, "frame_start": frame_start})
