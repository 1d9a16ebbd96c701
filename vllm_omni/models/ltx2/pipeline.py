"""LTX-2 text-to-video with audio, natively: Gemma3 text encoder + text connectors, the joint audio-video DiT,
flow-match Euler, video VAE, audio VAE + vocoder.

Reference spec: diffusers `LTX2Pipeline.__call__` with classifier-free guidance only (`stg_scale=0`,
`modality_scale=1`, `guidance_rescale=0`, the audio guidance equal to the video one). With the same weights and
seed the frames and the waveform match it:
  1. resolve sizes (height/width multiples of the VAE's spatial factor, `num_frames` rounded to 8k+1 at the
     real VAE), the audio length from the clip's duration (`num_frames / fps`),
  2. Gemma3 hidden states of every layer (left-padded to `max_sequence_length`) through the connectors, which
     give the video and the audio text tokens,
  3. noise per request from `torch.Generator("cpu").manual_seed(seed)`: the video latents, then the audio
     latents, packed into tokens,
  4. denoise both modalities in one DiT forward per step (positive and negative rows together), one Euler
     step over both (their sigmas are the same),
  5. decode the video latents with the VAE and the audio latents with the audio VAE, then the vocoder.
Two-stage variant (`two_stage=True`; diffusers' "Two-stages Generation" recipe, LTX-2's `ti2vid_two_stages`): steps
1-4 at half the requested height and width, then the video latents through the checkpoint's x2 latent upsampler
(`latent_upsampler/`, diffusers' `LTX2LatentUpsamplePipeline`), both modalities re-noised to the first of
`STAGE_2_DISTILLED_SIGMA_VALUES` from the request's generator, 3 more steps on those sigmas at full size without
guidance and with the distilled LoRA (the repo's `ltx-2-19b-distilled-lora-384.safetensors`, or the request's
`refine_lora`; diffusers' recipe loads it for stage 2 only) on the rows, then 5. The passes are one step sequence
of one state: the last base step switches the state's latents, geometry, guidance and scheduler to the refine
pass's (`scheduler_step`), and the rows run the refine adapter from then on (`row_adapters`).
Video and audio latents of a sample live in ONE flat row (`state.latents`: rows x (video + audio numbers)), so
abort, co-batching and the scheduler treat them as one sample.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np
import torch
from PIL import Image
from torch import nn

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.diffusion.timing import elapsed_since, synchronized_now
from vllm_omni.diffusion.video_utils import to_uint8_frames
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.lora import LoRARef, parse_refine_lora
from vllm_omni.logger import init_logger
from vllm_omni.models.ltx2.cache import PRESETS
from vllm_omni.models.ltx2.shapes import (
    DEFAULT_HEIGHT,
    DEFAULT_NUM_FRAMES,
    DEFAULT_NUM_INFERENCE_STEPS,
    DEFAULT_WIDTH,
    SIZE_MULTIPLE,
)

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.models.ltx2.transformer import LTX2VideoTransformer3DModel

logger = init_logger(__name__)

DEFAULT_GUIDANCE_SCALE = 4.0
DEFAULT_FPS = 24
DEFAULT_MAX_SEQUENCE_LENGTH = 1024
_UNSUPPORTED = ("guidance_scale_2", "boundary_ratio", "flow_shift", "true_cfg_scale")
"""Sampling knobs of other families that LTX-2 has no meaning for: a 400 rather than silently ignored."""
DISTILLED_LORA = "ltx-2-19b-distilled-lora-384.safetensors"
"""The refine pass's distilled LoRA at the root of Lightricks/LTX-2, beside the diffusers folders (diffusers'
recipe: `load_lora_weights("Lightricks/LTX-2", weight_name=DISTILLED_LORA)`); LTX-2's own key layout
(`diffusion_model.<module>.lora_A/B.weight`), which `LTX2LoraLoaderMixin` converts."""


@dataclass(frozen=True)
class LTX2Geometry:
    height: int
    width: int
    num_frames: int
    fps: int
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_frames: int
    """Audio latent frames (tokens) of the clip's duration."""
    audio_mel_bins: int
    """Latent mel bins per audio frame."""


@dataclass
class LTX2Conditioning(Conditioning):
    geometry: LTX2Geometry
    video_embeds: torch.Tensor
    """Connector tokens for the video stream: one row per latent row, then (CFG) the negatives in that order."""
    audio_embeds: torch.Tensor
    text_mask: torch.Tensor
    """(text rows, tokens) 1 where a connector token is real."""
    cfg: CFG | None
    first_frame: torch.Tensor | None = None
    """Image-to-video: (video tokens,) 1 on the tokens of the first latent frame, which hold the encoded input
    image and stay clean (timestep 0, no update); None for text-to-video."""
    refine: LTX2Refine | None = None
    """Two-stage variant, during its base pass: what the refine pass needs; None otherwise."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> LTX2Conditioning:
        refine = self.refine
        if refine is not None:
            refine = replace(refine, generators=[refine.generators[i] for i in rows.tolist()])
        return replace(
            self,
            video_embeds=self.video_embeds.index_select(0, text_rows),
            audio_embeds=self.audio_embeds.index_select(0, text_rows),
            text_mask=self.text_mask.index_select(0, text_rows),
            refine=refine,
        )


@dataclass
class LTX2Refine:
    """The refine pass of the two-stage variant."""

    geometry: LTX2Geometry
    """The requested (full) size; the base pass runs at half its height and width."""
    base_steps: int
    """Steps of the base pass; the refine pass starts after the last of them."""
    scheduler: Any = None
    """The refine pass's scheduler, its timesteps set (`prepare_step_tables`)."""
    generators: list[torch.Generator] = field(default_factory=list)
    """Per latent row: its request's generator, which drew the base pass's noise and draws the re-noising next
    (one generator per run, as diffusers' recipe and LTX-2 pass it to both passes)."""


@dataclass
class LTX2StepInput:
    x: torch.Tensor = rows()
    """Flat (rows, video + audio numbers) latents in the DiT's dtype."""
    timestep: torch.Tensor = rows()
    video_timestep: torch.Tensor | None = rows()
    """Image-to-video: (rows, video tokens), 0 on the first frame's tokens."""
    video_embeds: torch.Tensor = rows(text=True)
    audio_embeds: torch.Tensor = rows(text=True)
    text_mask: torch.Tensor = rows(text=True)
    video_shape: tuple[int, int, int]
    audio_frames: int
    fps: int


def request_image(request: OmniDiffusionRequest) -> Image.Image | None:
    """The request's first frame (image-to-video), None for text-to-video."""
    image = (request.multi_modal_data or {}).get("image")
    if image is None:
        return None
    if isinstance(image, list | tuple):
        if len(image) != 1:
            raise OmniClientError(f"image-to-video takes exactly one image, got {len(image)}", param="image")
        image = image[0]
    if not isinstance(image, Image.Image):
        raise OmniClientError("image-to-video needs multi_modal_data['image'] as a PIL image", param="image")
    return image.convert("RGB")


class LTX2Pipeline(NativeDiffusionPipeline):
    """Text (and optionally a first frame: image-to-video) to a video clip with its soundtrack (LTX-2 one-stage).

    One pipeline serves both, as the one Lightricks/LTX-2 checkpoint does (diffusers' `LTX2Pipeline` and
    `LTX2ImageToVideoPipeline`): a request with `multi_modal_data["image"]` is image-to-video."""

    progress_desc: ClassVar[str] = "LTX-2 denoise"
    lora_loader: ClassVar[str | None] = "LTX2LoraLoaderMixin"
    supports_two_stage: ClassVar[bool] = True

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        device: torch.device,
        dtype: torch.dtype,
        tokenizer: Any,
        text_encoder: nn.Module,
        connectors: nn.Module,
        transformer: LTX2VideoTransformer3DModel,
        vae: nn.Module,
        audio_vae: nn.Module,
        vocoder: nn.Module,
        scheduler_config: dict[str, Any],
        latent_upsampler: nn.Module | None = None,
        distilled_lora: Path | None = None,
    ) -> None:
        super().__init__()
        self.od_config = od_config
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.connectors = connectors
        self.transformer = transformer
        self.vae = vae
        self.audio_vae = audio_vae
        self.vocoder = vocoder
        self.scheduler_config = scheduler_config
        self.latent_upsampler = latent_upsampler
        """The two-stage variant's x2 spatial upsampler; None where the checkpoint has no `latent_upsampler/`."""
        self.distilled_lora = distilled_lora
        """The checkpoint's `DISTILLED_LORA` file (the refine pass's default adapter); None where it has none."""
        if distilled_lora is not None and latent_upsampler is not None and not od_config.enable_lora:
            logger.warning(
                "%s is not applied: two_stage refines with the base weights (not diffusers' recipe). Serve with "
                "--enable-lora (and --max-lora-rank at least its rank) to apply it",
                distilled_lora.name,
            )

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> Self:
        model_dir = Path(model_dir)
        components = cls._load_components(od_config, model_dir, device, dtype)
        logger.info("Loaded %s from %s (%s, %s)", cls.__name__, model_dir, device, dtype)
        return cls(od_config=od_config, device=device, dtype=dtype, **components)

    @classmethod
    def _load_components(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> dict[str, Any]:
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
        from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

        from vllm_omni.diffusion.model_loader.components import load_native_transformer
        from vllm_omni.diffusion.model_loader.dummy import load_pretrained
        from vllm_omni.models.ltx2.transformer import LTX2VideoTransformer3DModel

        fmt = od_config.load_format

        def load(cls_: type[nn.Module], name: str, component_dtype: torch.dtype = dtype) -> nn.Module:
            return load_pretrained(cls_, model_dir / name, device=device, dtype=component_dtype, load_format=fmt)

        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        tokenizer.padding_side = "left"  # Gemma's hidden states are read left-padded, as the model was trained
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return dict(
            tokenizer=tokenizer,
            text_encoder=load(Gemma3ForConditionalGeneration, "text_encoder"),
            connectors=load(LTX2TextConnectors, "connectors"),
            # Compiled blocks only: at video lengths the forward is GPU-bound (as Wan's).
            transformer=load_native_transformer(
                LTX2VideoTransformer3DModel, model_dir, "transformer", od_config, device, dtype, cuda_graphs=False
            ),
            vae=load(AutoencoderKLLTX2Video, "vae"),
            audio_vae=load(AutoencoderKLLTX2Audio, "audio_vae"),
            vocoder=load(LTX2Vocoder, "vocoder"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            # Small (a few convolutions); read when the repo has it, so that any request may ask for two stages.
            latent_upsampler=load(LTX2LatentUpsamplerModel, "latent_upsampler")
            if (model_dir / "latent_upsampler" / "config.json").is_file()
            else None,
            distilled_lora=model_dir / DISTILLED_LORA if (model_dir / DISTILLED_LORA).is_file() else None,
        )

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        self.validate_request(request)
        sp = request.sampling_params
        return (
            sp.height,
            sp.width,
            sp.num_frames,
            sp.fps,
            sp.num_inference_steps,
            sp.guidance_scale,
            sp.num_outputs_per_prompt,
            sp.max_sequence_length,
            request_image(request) is not None,
            bool(sp.two_stage),
        )

    def validate_request(self, request: OmniDiffusionRequest) -> None:
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")
        sp = request.sampling_params
        for name in _UNSUPPORTED:
            if getattr(sp, name) is not None:
                raise OmniClientError(f"{name} does not apply to LTX-2", param=name)
        image = request_image(request)
        if sp.two_stage:
            if self.latent_upsampler is None:
                raise OmniClientError(
                    "two_stage needs the checkpoint's latent upsampler (latent_upsampler/), which this one lacks",
                    param="two_stage",
                )
            if image is not None:
                raise OmniClientError("two_stage runs text-to-video only (no input image)", param="two_stage")
            if sp.partial_images:
                raise OmniClientError("partial_images are not previewed with two_stage", param="partial_images")
        elif sp.refine_lora is not None:
            raise OmniClientError("refine_lora is the adapter of two_stage's refine pass: set two_stage",
                                  param="refine_lora")
        self.resolve_geometry(sp)
        if sp.two_stage and self.lora_manager is None and sp.refine_lora is not None:
            raise OmniClientError("refine_lora: this server was started without --enable-lora", param="refine_lora")
        if sp.two_stage and self.lora_manager is not None and self.refine_adapter(request) is None:
            raise OmniClientError(
                f"two_stage refines with a distilled LoRA and this checkpoint has no {DISTILLED_LORA}: give "
                'refine_lora {"path": ...}',
                param="refine_lora",
            )

    # ---- LoRA: the refine pass's distilled adapter -----------------------------------------------------------

    def refine_adapter(self, request: OmniDiffusionRequest) -> LoRARef | None:
        """The adapter of a two-stage request's refine pass: its `refine_lora`, else the checkpoint's distilled
        LoRA at scale 1 (diffusers' `set_adapters("stage_2_distilled", 1.0)`); None for one stage, or with LoRA
        off (the refine pass then runs the base weights)."""
        sp = request.sampling_params
        if not sp.two_stage or self.lora_manager is None:
            return None
        ref = parse_refine_lora(sp.refine_lora)
        if ref is None and self.distilled_lora is not None:
            ref = LoRARef(DISTILLED_LORA, str(self.distilled_lora), 1.0)
        return ref

    def request_adapters(self, request: OmniDiffusionRequest) -> tuple[LoRARef, ...]:
        refine = self.refine_adapter(request)
        return super().request_adapters(request) + ((refine,) if refine is not None else ())

    def row_adapters(self, state: DenoiseState, request: OmniDiffusionRequest) -> tuple[LoRARef, ...]:
        """The base pass: the request's `lora`; the refine pass: that plus the distilled adapter (LTX-2's
        `ti2vid_two_stages` keeps the user's LoRAs in stage 2 and adds the distilled one)."""
        own = super().row_adapters(state, request)
        refine = self.refine_adapter(request) if state.conditioning.refine is None else None
        return own + ((refine,) if refine is not None else ())

    def load_loras(self, requests: list[OmniDiffusionRequest]) -> None:
        """Also the refine adapters (a bad file is a 400 naming `refine_lora`); both passes' adapters of a request
        must fit `--max-loras` together."""
        super().load_loras(requests)
        for request in requests:
            refine = self.refine_adapter(request)
            if refine is None:
                continue
            needed = {ref.path for ref in self.request_adapters(request)}
            if len(needed) > self.lora_manager.max_loras:
                raise OmniClientError(
                    f"two_stage's refine pass runs lora and refine_lora together: {len(needed)} adapters, this "
                    f"server keeps {self.lora_manager.max_loras} resident (--max-loras)",
                    param="refine_lora",
                )
            try:
                self.lora_manager.load(refine)
            except OmniClientError as exc:
                raise OmniClientError(f"refine_lora: {exc.message}", param="refine_lora") from None

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> LTX2Conditioning:
        sp = requests[0].sampling_params
        geometry = self.resolve_geometry(sp)
        refine = None
        if sp.two_stage:
            steps = sp.num_inference_steps or DEFAULT_NUM_INFERENCE_STEPS
            refine, geometry = LTX2Refine(geometry, steps), self.base_geometry(geometry)
        guidance = DEFAULT_GUIDANCE_SCALE if sp.guidance_scale is None else float(sp.guidance_scale)
        cfg = CFG(guidance) if guidance > 1.0 else None
        video, audio, mask = self.encode_texts(
            [text for text, _ in prompt_rows(requests, cfg)], sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        )
        per = sp.num_outputs_per_prompt
        first_frame = None
        if request_image(requests[0]) is not None:
            first_frame = torch.zeros(geometry.latent_frames, geometry.latent_height * geometry.latent_width)
            first_frame[0] = 1
            first_frame = first_frame.flatten().to(self.device)
        return LTX2Conditioning(
            geometry,
            video.repeat_interleave(per, 0),
            audio.repeat_interleave(per, 0),
            mask.repeat_interleave(per, 0),
            cfg,
            first_frame,
            refine,
        )

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: LTX2Conditioning) -> torch.Tensor:
        """Per request from its own CPU generator: video noise, then audio noise (diffusers' order). Two stages:
        the generators are kept for the refine pass's noise."""
        g = conditioning.geometry
        per = requests[0].sampling_params.num_outputs_per_prompt
        video_shape = (per, self.transformer.config.in_channels, g.latent_frames, g.latent_height, g.latent_width)
        audio_shape = (per, self.audio_vae.config.latent_channels, g.audio_frames, g.audio_mel_bins)
        noise = []
        for request in requests:
            seed = request.sampling_params.seed
            generator = torch.Generator(device="cpu").manual_seed(shared_random_seed() if seed is None else seed)
            video = torch.randn(video_shape, generator=generator, dtype=torch.float32)
            audio = torch.randn(audio_shape, generator=generator, dtype=torch.float32)
            if conditioning.first_frame is not None:  # the image's latents replace the first frame's noise
                video[:, :, :1] = self.encode_image(request_image(request), g).expand(per, -1, -1, -1, -1)
            noise.append(self.pack(video, audio))
            if conditioning.refine is not None:
                conditioning.refine.generators += [generator] * per
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        sp = requests[0].sampling_params
        steps = sp.num_inference_steps or DEFAULT_NUM_INFERENCE_STEPS
        g = self.resolve_geometry(sp)
        if sp.two_stage:
            g = self.base_geometry(g)
        cfg = self.scheduler_config
        mu = calculate_shift(
            g.latent_frames * g.latent_height * g.latent_width,
            cfg.get("base_image_seq_len", 1024),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.95),
            cfg.get("max_shift", 2.05),
        )
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare_step_tables(self, state: DenoiseState) -> None:
        """Two stages: the refine pass's scheduler (diffusers' recipe: the distilled sigmas as they are, no
        dynamic shift), its timesteps appended to the base pass's, so one state runs both passes."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

        refine = state.conditioning.refine
        if refine is None:
            return
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            self.scheduler_config, use_dynamic_shifting=False, shift_terminal=None
        )
        scheduler.set_timesteps(sigmas=STAGE_2_DISTILLED_SIGMA_VALUES, device=self.device)
        scheduler.set_begin_index(0)
        refine.scheduler = scheduler
        num_train = scheduler.config.num_train_timesteps
        state.timesteps = torch.cat([state.timesteps, scheduler.timesteps])
        state.normalized_timesteps += [t / num_train for t in scheduler.timesteps.tolist()]

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same geometry (token counts and RoPE positions) and text length; prompts, seeds, guidance, CFG on/off
        and step counts may differ."""
        cond = state.conditioning
        return (cond.geometry, cond.video_embeds.shape[1], cond.first_frame is not None, state.latents.dtype)

    def step_tokens(self, state: DenoiseState) -> int:
        cond, g = state.conditioning, state.conditioning.geometry
        return self.transformer_rows(state) * (
            g.latent_frames * g.latent_height * g.latent_width + g.audio_frames + cond.video_embeds.shape[1]
        )

    def step_inputs(self, state: DenoiseState) -> LTX2StepInput:
        cond, g = state.conditioning, state.conditioning.geometry
        x = state.latents
        timestep = state.timesteps[state.step_index].expand(x.shape[0])
        video_timestep = None
        if cond.first_frame is not None:  # the given first frame's tokens are clean: timestep 0
            video_timestep = timestep[:, None] * (1 - cond.first_frame)[None].to(timestep.dtype)
        return LTX2StepInput(
            x.to(self.dtype),
            timestep,
            video_timestep,
            cond.video_embeds,
            cond.audio_embeds,
            cond.text_mask,
            (g.latent_frames, g.latent_height, g.latent_width),
            g.audio_frames,
            g.fps,
        )

    def transformer_forward(self, inp: LTX2StepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call(
            "transformer",
            inp.x,
            inp.timestep,
            inp.video_embeds,
            inp.audio_embeds,
            inp.text_mask,
            video_timestep=inp.video_timestep,
            video_shape=inp.video_shape,
            audio_frames=inp.audio_frames,
            fps=float(inp.fps),
        ).float()

    def combine_cfg(self, state: DenoiseState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """LTX-2's form, over each flat video + audio row (the audio guided with the video's scale)."""
        return cond + (self.cfg_scale(state) - 1) * (cond - uncond)

    def scheduler_step(self, state: DenoiseState, noise_pred: torch.Tensor) -> torch.Tensor:
        """Image-to-video: the first frame's tokens get no update (they stay the image's latents)."""
        first_frame = state.conditioning.first_frame
        if first_frame is not None:
            channels = self.transformer.config.in_channels
            keep = torch.zeros_like(noise_pred[0])
            keep[: first_frame.numel() * channels] = first_frame.repeat_interleave(channels)
            noise_pred = noise_pred * (1 - keep)
        latents = super().scheduler_step(state, noise_pred)
        refine = state.conditioning.refine
        if refine is not None and state.step_index == refine.base_steps - 1:
            latents = self.start_refine(state, latents)
        return latents

    def start_refine(self, state: DenoiseState, latents: torch.Tensor) -> torch.Tensor:
        """After the base pass: the refine pass's initial latents (the video latents upsampled x2, both modalities
        re-noised to the refine pass's first sigma), and the state switched to that pass: full-size geometry, no
        guidance (its prompt rows only), its scheduler. Mirrors diffusers' recipe: the base output denormalized
        (`output_type="latent"`), `LTX2LatentUpsamplePipeline`, then `LTX2Pipeline(latents=..., noise_scale=...)`."""
        from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

        cond, refine = state.conditioning, state.conditioning.refine
        video, audio = self.unpack(latents, cond.geometry)
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(video)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(video)
        scaling = self.vae.config.scaling_factor
        video = self.latent_upsampler((video * std / scaling + mean).to(self.latent_upsampler.dtype))
        video = ((video - mean.to(video)) * scaling / std.to(video)).flatten(2).transpose(1, 2)  # packed tokens
        sigma = STAGE_2_DISTILLED_SIGMA_VALUES[0]
        per = state.outputs_per_request
        noised = []
        for i in range(0, video.shape[0], per):  # per request from its generator: video noise, then audio noise
            generator = refine.generators[i]
            rows = slice(i, i + per)
            video_noise = torch.randn(video[rows].shape, generator=generator, dtype=video.dtype).to(video.device)
            audio_noise = torch.randn(audio[rows].shape, generator=generator, dtype=audio.dtype).to(audio.device)
            noised.append(
                torch.cat(
                    [
                        (sigma * video_noise + (1 - sigma) * video[rows]).flatten(1).float(),
                        (sigma * audio_noise + (1 - sigma) * audio[rows]).flatten(1).float(),
                    ],
                    dim=1,
                )
            )
        num_latent = latents.shape[0]
        text_rows = torch.arange(num_latent, device=cond.text_mask.device)  # the prompts' rows: no guidance
        state.conditioning = replace(cond.select(text_rows, text_rows), geometry=refine.geometry, cfg=None, refine=None)
        state.scheduler = refine.scheduler
        state.cache.invalidate()  # its residuals have the base pass's shapes
        return torch.cat(noised)

    def finish(self, state: DenoiseState, ctx: StepContext) -> list[DiffusionOutput]:
        start = synchronized_now(self.device)  # step mode: the last steps may still be queued
        frames, waveform = self.decode_av(state)
        state.durations["vae_decode"] = elapsed_since(start, self.device)
        g, per = state.conditioning.geometry, state.outputs_per_request
        sample_rate = int(self.vocoder.config.output_sampling_rate)
        outputs = []
        for i in range(len(state.requests)):
            video, audio = frames[i * per : (i + 1) * per], waveform[i * per : (i + 1) * per]
            output = {
                "video": video[0] if per == 1 else video,
                "fps": g.fps,
                "audio": audio[0] if per == 1 else audio,
                "sample_rate": sample_rate,
            }
            outputs.append(
                DiffusionOutput(output=output, stage_durations=dict(state.durations), extra=self.output_extra(state))
            )
        return outputs

    def decode(self, state: DenoiseState) -> list[np.ndarray]:
        """Frames only (previews)."""
        return list(self.decode_av(state)[0])

    # ---- stages --------------------------------------------------------------------------------------------

    def resolve_geometry(self, sp: OmniDiffusionSamplingParams) -> LTX2Geometry:
        """The requested clip's sizes (two stages: the refine pass's, twice the base pass's height and width)."""
        height, width = sp.height or DEFAULT_HEIGHT, sp.width or DEFAULT_WIDTH
        spatial = max(SIZE_MULTIPLE, self.vae.spatial_compression_ratio * self.transformer.config.patch_size)
        if sp.two_stage:  # the base pass's half size must be a valid size too
            spatial *= 2
        temporal = self.vae.temporal_compression_ratio
        for name, value in (("height", height), ("width", width)):
            if value % spatial:
                variant = " two-stage" if sp.two_stage else ""
                raise OmniClientError(
                    f"{name} must be a multiple of {spatial} for LTX-2{variant}, got {value}", param=name
                )
        num_frames = sp.num_frames or DEFAULT_NUM_FRAMES
        if num_frames % temporal != 1:
            rounded = num_frames // temporal * temporal + 1
            logger.warning("num_frames=%d is not %dk+1; using %d", num_frames, temporal, rounded)
            num_frames = rounded
        fps = sp.fps or DEFAULT_FPS
        audio_cfg = self.audio_vae.config
        per_second = audio_cfg.sample_rate / audio_cfg.mel_hop_length / self.audio_vae.temporal_compression_ratio
        return LTX2Geometry(
            height,
            width,
            num_frames,
            fps,
            (num_frames - 1) // temporal + 1,
            height // self.vae.spatial_compression_ratio,
            width // self.vae.spatial_compression_ratio,
            round(num_frames / fps * per_second),
            audio_cfg.mel_bins // self.audio_vae.mel_compression_ratio,
        )

    def base_geometry(self, g: LTX2Geometry) -> LTX2Geometry:
        """The two-stage variant's base pass: half the height and width (LTX-2's `stage_1_height/width`)."""
        return replace(
            g,
            height=g.height // 2,
            width=g.width // 2,
            latent_height=g.latent_height // 2,
            latent_width=g.latent_width // 2,
        )

    def encode_image(self, image: Image.Image, g: LTX2Geometry) -> torch.Tensor:
        """The first frame's normalized latents (1, C, 1, h, w): the image re-compressed with H.264 at the CRF the
        model was trained with (as LTX-2's reference preprocessing does), resized, VAE-encoded (mode)."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from diffusers.video_processor import VideoProcessor

        crf = resolve_default_image_crf(self.text_encoder)
        if crf:
            image = Image.fromarray(apply_image_conditioning_crf(np.asarray(image), crf))
        processor = VideoProcessor(vae_scale_factor=self.vae.spatial_compression_ratio)
        pixels = processor.preprocess(image, height=g.height, width=g.width).to(self.device, self.dtype)
        latent = self.vae.encode(pixels.unsqueeze(2).to(self.vae.dtype)).latent_dist.mode().float()
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(latent)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(latent)
        return ((latent - mean) / std).cpu()  # diffusers normalizes the image latents without scaling_factor

    def encode_texts(self, prompts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every Gemma3 layer's hidden states (stacked per token) through the connectors: (video tokens, audio
        tokens, their mask)."""
        inputs = self.tokenizer(
            [p.strip() for p in prompts],
            padding="max_length",
            max_length=max_len,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.dtype)
        return self.connectors(embeds, mask, padding_side=self.tokenizer.padding_side)

    def pack(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """(B, C, F, H, W) video and (B, C, L, M) audio latents -> flat (B, video tokens * C + audio tokens * C*M)
        rows, the tokens ordered as diffusers packs them (patch size 1)."""
        if self.transformer.config.patch_size != 1 or self.transformer.config.patch_size_t != 1:
            raise ValueError("LTX-2 checkpoints with a transformer patch size above 1 are not supported")
        return torch.cat([video.flatten(2).transpose(1, 2).flatten(1), audio.transpose(1, 2).flatten(1)], dim=1)

    def unpack(self, flat: torch.Tensor, g: LTX2Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        channels = self.transformer.config.in_channels
        split = g.latent_frames * g.latent_height * g.latent_width * channels
        video = flat[:, :split].view(flat.shape[0], g.latent_frames, g.latent_height, g.latent_width, channels)
        audio = flat[:, split:].view(flat.shape[0], g.audio_frames, -1)
        return video.permute(0, 4, 1, 2, 3), audio

    def decode_av(self, state: DenoiseState) -> tuple[np.ndarray, np.ndarray]:
        """uint8 frames (rows, T, H, W, 3) and float32 waveforms (rows, channels, samples)."""
        g = state.conditioning.geometry
        video, audio = self.unpack(state.latents, g)
        vae_cfg = self.vae.config
        video = video.to(self.dtype)  # diffusers denormalizes in the DiT's dtype
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(video)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(video)
        video = (video * std / vae_cfg.scaling_factor + mean).to(self.vae.dtype)
        timestep = None
        if vae_cfg.timestep_conditioning:  # decode_timestep 0: the latents as they are, at t = 0
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        frames = to_uint8_frames(self.vae.decode(video, timestep, return_dict=False)[0])
        audio = audio * self.audio_vae.latents_std.to(audio) + self.audio_vae.latents_mean.to(audio)
        audio = audio.unflatten(2, (-1, g.audio_mel_bins)).transpose(1, 2)
        mel = self.audio_vae.decode(audio.to(self.audio_vae.dtype), return_dict=False)[0]
        waveform = self.vocoder(mel).float().cpu().numpy()
        return frames, waveform
