"""Wan 2.1 / 2.2 text-to-video, natively: UMT5 text encoder, our Wan DiT (one or two experts), UniPC, Wan VAE.

Reference spec: diffusers `WanPipeline.__call__`. The steps below follow it so that, with the same weights
and seed, the decoded frames match:
  1. resolve sizes (height/width multiples of 16, `num_frames` rounded to 4k+1),
  2. encode prompt and negative prompt (zero-padded to `max_sequence_length`),
  3. draw noise per request with `torch.Generator("cpu").manual_seed(seed)`, shape (n_outputs, 16, T, h, w),
  4. denoise with true CFG (positive and negative rows in one DiT forward); Wan2.2 A14B switches from the
     high-noise `transformer` to the low-noise `transformer_2` once t < boundary_ratio * 1000, with
     `guidance_scale_2`,
  5. un-normalize latents and decode them with the causal VAE.
Requests whose sampling-params keys agree (the scheduler guarantees it) share every forward.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.timing import elapsed_since
from vllm_omni.diffusion.video_utils import STREAMED_FRAMES, iter_wan_vae_decode, to_uint8_frames
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    from typing import Self

    from diffusers import AutoencoderKLWan

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
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
class WanConditions:
    """Per-row extras of image-conditioned pipelines (None for text-to-video)."""

    latents: torch.Tensor | None = None
    """Channels concatenated to the noisy latents (I2V: 4 mask channels + 16 image-latent channels)."""
    image_embeds: torch.Tensor | None = None
    """CLIP tokens for the DiT's image cross-attention branch."""
    first_frame_mask: torch.Tensor | None = None
    """Wan2.2 TI2V: (1, 1, T, h, w), 0 on the given first frame (whose latents are `latents`), 1 elsewhere; the
    DiT sees the first frame's latents there and a timestep of 0 on its tokens."""


class WanPipeline(nn.Module):
    """Text-to-video for Wan2.1 (one DiT) and Wan2.2 A14B (high/low-noise expert pair)."""

    supports_request_batch: ClassVar[bool] = True

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

    # ---- request handling ----------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext | None = None) -> list[DiffusionOutput]:
        """One output per request; a request that is invalid alone fails alone (`ctx` None: used standalone)."""
        ctx = ctx or StepContext(self.od_config, request_ids=batch.request_ids)
        outputs: list[DiffusionOutput | None] = [None] * len(batch.requests)
        valid: list[int] = []
        for i, request in enumerate(batch.requests):
            try:
                self.validate_request(request)
                valid.append(i)
            except OmniClientError as exc:
                outputs[i] = DiffusionOutput.from_exception(exc)
        if valid:
            try:
                results = self.generate([batch.requests[i] for i in valid], ctx)
            except OmniClientError as exc:  # a shared parameter is invalid: every request says why
                results = [DiffusionOutput.from_exception(exc) for _ in valid]
            for i, result in zip(valid, results, strict=True):
                outputs[i] = result
        return [out for out in outputs if out is not None]

    def validate_request(self, request: OmniDiffusionRequest) -> None:
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")

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

    def generate(self, requests: list[OmniDiffusionRequest], ctx: StepContext) -> list[DiffusionOutput]:
        sp = requests[0].sampling_params
        geometry = self.resolve_geometry(sp)
        guidance, guidance_2, boundary = self.resolve_guidance(sp)
        do_cfg = guidance > 1.0  # diffusers decides CFG on the first expert's scale only
        per_prompt = sp.num_outputs_per_prompt
        durations: dict[str, float] = {}

        start = time.perf_counter()
        max_len = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        prompts = [r.prompt_text for r in requests]
        negatives = [r.negative_prompt or "" for r in requests] if do_cfg else []
        embeds = self.encode_prompt(prompts + negatives, max_len).repeat_interleave(per_prompt, dim=0)
        durations["text_encoder"] = elapsed_since(start, self.device)

        latents = self.prepare_latents(requests, geometry, per_prompt)
        conditions = self.prepare_conditions(requests, geometry, durations)

        start = time.perf_counter()
        latents = self.denoise(latents, embeds, conditions, sp, guidance, guidance_2, boundary, do_cfg, ctx)
        durations["denoise"] = elapsed_since(start, self.device)

        fps = sp.fps or DEFAULT_FPS
        streamed = {r.request_id for r in requests if r.sampling_params.stream_partial_outputs} \
            if ctx.partials_enabled else set()
        start = time.perf_counter()
        frames = self.decode(latents, ctx, requests, streamed, per_prompt, fps)
        durations["vae_decode"] = elapsed_since(start, self.device)

        outputs = []
        for i, request in enumerate(requests):
            if request.request_id in streamed:  # its frames crossed as chunks; the engine side joins them
                output = {STREAMED_FRAMES: geometry.num_frames, "fps": fps}
            else:
                video = frames[i * per_prompt:(i + 1) * per_prompt]
                output = {"video": video[0] if per_prompt == 1 else video, "fps": fps}
            outputs.append(DiffusionOutput(output=output, stage_durations=dict(durations)))
        return outputs

    # ---- stages --------------------------------------------------------------------------------------------

    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """UMT5 last hidden states, cut at each prompt's length and zero-padded back (as the model was trained)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask).last_hidden_state.to(self.dtype)
        keep = torch.arange(max_sequence_length, device=self.device)[None, :] < mask.sum(dim=1, keepdim=True)
        return hidden * keep[..., None].to(hidden.dtype)

    def prepare_latents(self, requests: list[OmniDiffusionRequest], geometry: WanGeometry, per_prompt: int
                        ) -> torch.Tensor:
        """Noise per request from its own CPU generator, the same draw diffusers makes for that seed."""
        shape = (per_prompt, self.vae.config.z_dim, geometry.latent_frames, geometry.latent_height,
                 geometry.latent_width)
        noise = []
        for request in requests:
            seed = request.sampling_params.seed
            generator = torch.Generator(device="cpu").manual_seed(random.getrandbits(63) if seed is None else seed)
            noise.append(torch.randn(shape, generator=generator, dtype=torch.float32))
        return torch.cat(noise).to(self.device)

    def prepare_conditions(self, requests: list[OmniDiffusionRequest], geometry: WanGeometry,
                           durations: dict[str, float]) -> WanConditions:
        return WanConditions()

    def make_scheduler(self, sp: OmniDiffusionSamplingParams) -> Any:
        import diffusers

        cls = getattr(diffusers, self.scheduler_config["_class_name"])
        overrides = {} if sp.flow_shift is None else {"flow_shift": float(sp.flow_shift)}
        return cls.from_config(self.scheduler_config, **overrides)

    def denoise(self, latents: torch.Tensor, embeds: torch.Tensor, conditions: WanConditions,
                sp: OmniDiffusionSamplingParams, guidance: float, guidance_2: float, boundary: float | None,
                do_cfg: bool, ctx: StepContext) -> torch.Tensor:
        scheduler = self.make_scheduler(sp)
        steps = sp.num_inference_steps or DEFAULT_NUM_INFERENCE_STEPS
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        rows = latents.shape[0]
        image_embeds = conditions.image_embeds
        if do_cfg and image_embeds is not None:
            image_embeds = torch.cat([image_embeds, image_embeds])
        num_train = self.scheduler_config.get("num_train_timesteps", 1000)
        show = self.od_config.enable_progress_bar
        with tqdm(total=len(scheduler.timesteps), desc="Wan denoise", disable=not show) as progress:
            for i, t in enumerate(scheduler.timesteps):
                ctx.step_index, ctx.timestep = i, float(t) / num_train
                high_noise = boundary is None or t >= boundary
                model = self.transformer if high_noise else self.transformer_2
                scale = guidance if high_noise else guidance_2
                x = self.model_input(latents, conditions)
                x = torch.cat([x, x]) if do_cfg else x
                pred = model(x.to(self.dtype), self.model_timestep(t, x, conditions), embeds, image_embeds)
                if do_cfg:
                    cond, uncond = pred[:rows], pred[rows:]
                    pred = uncond + scale * (cond - uncond)
                latents = scheduler.step(pred, t, latents, return_dict=False)[0]
                progress.update()
                ctx.report_progress(i + 1, len(scheduler.timesteps))
        ctx.step_index = ctx.timestep = None
        if conditions.first_frame_mask is not None:
            latents = self.model_input(latents, conditions)
        return latents

    @staticmethod
    def model_input(latents: torch.Tensor, conditions: WanConditions) -> torch.Tensor:
        if conditions.first_frame_mask is not None:  # TI2V: the given first frame replaces the noisy one
            mask = conditions.first_frame_mask
            return (1 - mask) * conditions.latents + mask * latents
        if conditions.latents is not None:  # Wan2.1 I2V: conditioning channels ride along
            return torch.cat([latents, conditions.latents], dim=1)
        return latents

    def model_timestep(self, t: torch.Tensor, x: torch.Tensor, conditions: WanConditions) -> torch.Tensor:
        """(rows,), or (rows, tokens) for Wan2.2 TI2V, where first-frame tokens of an I2V request get 0."""
        if not self.expand_timesteps:
            return t.expand(x.shape[0])
        _, p_h, p_w = self.transformer.config.patch_size
        mask = conditions.first_frame_mask
        if mask is None:
            mask = torch.ones(1, 1, *x.shape[2:], device=x.device)
        return (mask[0, 0, :, ::p_h, ::p_w] * t).flatten().unsqueeze(0).expand(x.shape[0], -1)

    def normalize_latents(self, latents: torch.Tensor, *, inverse: bool) -> torch.Tensor:
        """Map between the DiT's normalized latent space and the VAE's (per-channel mean / std of the VAE)."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean if inverse else (latents - mean) * inv_std

    def decode(self, latents: torch.Tensor, ctx: StepContext, requests: Sequence[OmniDiffusionRequest] = (),
               streamed: Set[str] = frozenset(), per_prompt: int = 1, fps: int = DEFAULT_FPS) -> Any:
        """Latents -> uint8 frames (rows, T, H, W, 3), decoded chunk by chunk through the causal VAE.

        Each decoded chunk is also sent to the listeners of the `requests` (rows `per_prompt` each) whose ids are
        in `streamed`, shaped like the final output, as soon as it exists, so clients see the first frames early.
        """
        latents = self.normalize_latents(latents.to(self.vae.dtype), inverse=True)
        chunks, frame_start = [], 0
        for chunk in iter_wan_vae_decode(self.vae, latents):
            chunks.append(chunk)
            if streamed:
                frames = to_uint8_frames(chunk)
                for i, request in enumerate(requests):
                    if request.request_id not in streamed:
                        continue
                    video = frames[i * per_prompt:(i + 1) * per_prompt]
                    ctx.emit_partial(request.request_id, "video_chunk", {
                        "video": video[0] if per_prompt == 1 else video, "fps": fps, "frame_start": frame_start})
            frame_start += chunk.shape[2]
        return to_uint8_frames(torch.cat(chunks, dim=2))
