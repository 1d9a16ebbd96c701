"""HunyuanImage-2.1 text-to-image: Qwen2.5-VL + ByT5 (glyph) prompt encoders -> MMDiT -> 32x VAE.

Numerically diffusers' `HunyuanImagePipeline`: the same system-prompt template with its 34 leading tokens
dropped, the third-to-last hidden states; quoted text in the prompt ('...', "...", ‘...’, “...”) as
`Text "..."` through ByT5; the same noise for the same seed, sigmas `linspace(1, 0, steps + 1)[:-1]` under the
checkpoint's shift. Guidance follows the checkpoint:

- HunyuanImage-2.1 (`guider/`, `ocr_guider/`): adaptive projected guidance mixed with CFG
  (`AdaptiveProjectedMixGuidance`), the OCR guider for a prompt with quoted text, "" as the default negative
  prompt; `guidance_scale` on a request replaces the guider's `guidance_scale` (diffusers' `guider.new(...)`).
  Its APG momentum buffer is per request: it lives in the request's conditioning. 50 steps by default.
- HunyuanImage-2.1-Distilled (`guidance_embeds`, `use_meanflow`, no guider): no CFG; `guidance_scale` is the
  embedded (distilled) guidance, default 3.25; each step also embeds the next timestep (MeanFlow). 8 steps by
  default (the model card).

Rows carry only their real text tokens (transformer.py), not diffusers' 1000 + 128 padded ones.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.model_loader.components import load_native_transformer
from vllm_omni.diffusion.model_loader.dummy import load_pretrained
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.errors import OmniClientError
from vllm_omni.models.hunyuan_image_21.cache import PRESETS
from vllm_omni.models.hunyuan_image_21.transformer import HunyuanImageTransformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

DEFAULT_STEPS = 50
DISTILLED_STEPS = 8
"""HunyuanImage-2.1-Distilled's model card: 8 steps."""
DISTILLED_GUIDANCE = 3.25
"""diffusers' default `distilled_guidance_scale`."""
DEFAULT_SAMPLE_SIZE = 64
"""Latent side by default (diffusers' `default_sample_size`): 2048 pixels with the 32x VAE."""
MAX_PROMPT_TOKENS = 1000
MAX_GLYPH_TOKENS = 128
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
DROP_TOKENS = 34
"""Leading template tokens whose hidden states are dropped (diffusers' `prompt_template_encode_start_idx`)."""
_QUOTES = (r"\'(.*?)\'", r"\"(.*?)\"", r"‘(.*?)’", r"“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """The quoted text of `prompt` as diffusers' `extract_glyph_text` formats it for ByT5 (None: no quotes)."""
    found = [m for pattern in _QUOTES for m in re.findall(pattern, prompt)]
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


@dataclass(frozen=True)
class MixGuidance:
    """An `AdaptiveProjectedMixGuidance` config (guider/guider_config.json): CFG for the first steps (feeding
    the momentum buffer), adaptive projected guidance after `apg_start_step`."""

    guidance_scale: float = 3.5
    guidance_rescale: float = 0.0
    adaptive_projected_guidance_scale: float = 10.0
    adaptive_projected_guidance_momentum: float | None = -0.5
    adaptive_projected_guidance_rescale: float = 10.0
    eta: float = 0.0
    use_original_formulation: bool = False
    start: float = 0.0
    stop: float = 1.0
    adaptive_projected_guidance_start_step: int = 5
    enabled: bool = True

    @classmethod
    def read(cls, path: Path) -> MixGuidance | None:
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        if config.get("_class_name", "AdaptiveProjectedMixGuidance") != "AdaptiveProjectedMixGuidance":
            raise ValueError(f"{path}: only AdaptiveProjectedMixGuidance guiders are supported")
        return cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})

    def _off(self, scale: float) -> bool:
        return math.isclose(scale, 0.0 if self.use_original_formulation else 1.0)

    @property
    def active(self) -> bool:
        """Whether the request encodes negative prompts at all (diffusers asks before the first step)."""
        return self.enabled and not self._off(self.guidance_scale)

    def cfg_at(self, step: int, num_steps: int) -> bool:
        """Whether step `step` runs the negative rows (diffusers' `_is_cfg_enabled`)."""
        return self.active and int(self.start * num_steps) <= step < int(self.stop * num_steps)

    def apg_at(self, step: int, num_steps: int) -> bool:
        return self.cfg_at(step, num_steps) and step > self.adaptive_projected_guidance_start_step \
            and not self._off(self.adaptive_projected_guidance_scale)

    def combine(self, step: int, num_steps: int, pos: torch.Tensor, neg: torch.Tensor,
                momentum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(guided prediction, new momentum running average) of rows `pos` / `neg`, norms per row."""
        base = pos if self.use_original_formulation else neg
        if self.adaptive_projected_guidance_momentum is not None:
            diff = pos - neg
            momentum = diff if momentum is None else diff + self.adaptive_projected_guidance_momentum * momentum
        if not self.apg_at(step, num_steps):
            pred = base + self.guidance_scale * (pos - neg)
        else:
            diff = momentum if momentum is not None else pos - neg
            dims = list(range(1, diff.dim()))
            if self.adaptive_projected_guidance_rescale > 0:
                norm = diff.norm(p=2, dim=dims, keepdim=True)
                diff = diff * torch.minimum(torch.ones_like(diff), self.adaptive_projected_guidance_rescale / norm)
            v1 = torch.nn.functional.normalize(pos.double(), dim=dims)
            parallel = (diff.double() * v1).sum(dim=dims, keepdim=True) * v1
            orthogonal = diff.double() - parallel
            update = orthogonal.type_as(diff) + self.eta * parallel.type_as(diff)
            pred = base + self.adaptive_projected_guidance_scale * update
        if self.guidance_rescale > 0:
            dims = list(range(1, pos.dim()))
            rescaled = pred * (pos.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True))
            pred = self.guidance_rescale * rescaled + (1 - self.guidance_rescale) * pred
        return pred, momentum


@dataclass
class HunyuanImageConditioning(Conditioning):
    """Text rows: one per latent row, then (CFG) one negative per latent row in the same order."""

    embeds: torch.Tensor
    """(text rows, seq, dim): each row's real prompt tokens first, zero-padded at the end."""
    lengths: tuple[int, ...]
    glyph: torch.Tensor | None
    """(text rows, seq, ByT5 dim) likewise (seq 0 when no row has quoted text); None: no glyph encoder."""
    glyph_lengths: tuple[int, ...]
    guider: MixGuidance | None
    """None: no CFG (the distilled model, or guidance off)."""
    cfg: CFG | None
    """The guider's CFG scale; on at the steps the guider runs CFG (`HunyuanImagePipeline.step_cfg`)."""
    distilled_guidance: float | None
    grid: tuple[int, int]
    """Latent grid (height, width)."""
    momentum: torch.Tensor | None = None
    """The APG momentum running average of the latent rows (None: zero, before the first CFG step)."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> HunyuanImageConditioning:
        keep = text_rows.tolist()
        lengths = tuple(self.lengths[i] for i in keep)
        glyph_lengths = tuple(self.glyph_lengths[i] for i in keep)
        glyph = None if self.glyph is None else self.glyph.index_select(0, text_rows)[:, : max(glyph_lengths)]
        momentum = None if self.momentum is None else self.momentum.index_select(0, rows)
        return replace(self, embeds=self.embeds.index_select(0, text_rows)[:, : max(lengths)], lengths=lengths,
                       glyph=glyph, glyph_lengths=glyph_lengths, momentum=momentum)


@dataclass
class HunyuanImageStepInput:
    """One state's transformer rows at its step (`HunyuanImagePipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    timestep: torch.Tensor = rows()
    """(rows,) raw timesteps (0..1000) in the model's dtype, as diffusers passes them."""
    embeds: torch.Tensor = rows(pad=1, text=True)
    lengths: tuple[int, ...] = rows(text=True)
    glyph: torch.Tensor | None = rows(pad=1, text=True)
    glyph_lengths: tuple[int, ...] = rows(text=True)
    timestep_r: torch.Tensor | None = rows()
    guidance: torch.Tensor | None = rows()


class HunyuanImagePipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "HunyuanImage-2.1 denoise"
    compile_vae_decoder: ClassVar[bool] = True

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        transformer: HunyuanImageTransformer2DModel,
        text_encoder,
        tokenizer,
        text_encoder_2,
        tokenizer_2,
        vae,
        scheduler_config: dict[str, Any],
        guider: MixGuidance | None,
        ocr_guider: MixGuidance | None,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        from diffusers.image_processor import VaeImageProcessor

        self.od_config = od_config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.guider = guider
        self.ocr_guider = ocr_guider
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = vae.config.spatial_compression_ratio
        self.size_multiple = self.vae_scale_factor * transformer.patch_size[0]
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        if guider is not None and transformer.guidance_embeds:
            raise ValueError("a guidance-distilled HunyuanImage checkpoint with a CFG guider is not supported")

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> HunyuanImagePipeline:
        from diffusers import AutoencoderKLHunyuanImage
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, T5EncoderModel

        model_dir = Path(model_dir)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        return cls(
            od_config=od_config,
            transformer=load_native_transformer(
                HunyuanImageTransformer2DModel, model_dir, "transformer", od_config, device, dtype
            ),
            text_encoder=load(Qwen2_5_VLForConditionalGeneration, model_dir / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
            text_encoder_2=load(T5EncoderModel, model_dir / "text_encoder_2"),
            tokenizer_2=AutoTokenizer.from_pretrained(model_dir / "tokenizer_2"),
            vae=load(AutoencoderKLHunyuanImage, model_dir / "vae"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            guider=MixGuidance.read(model_dir / "guider" / "guider_config.json"),
            ocr_guider=MixGuidance.read(model_dir / "ocr_guider" / "guider_config.json"),
            device=device,
            dtype=dtype,
        )

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    @property
    def distilled(self) -> bool:
        return self.transformer.guidance_embeds

    def request_guider(self, request: OmniDiffusionRequest) -> MixGuidance | None:
        """The request's CFG guider (its `guidance_scale` in it), None when it runs without CFG."""
        if self.distilled:
            return None
        guider = self.ocr_guider if self.ocr_guider is not None and glyph_text(request.prompt_text) else self.guider
        scale = request.sampling_params.guidance_scale
        if guider is not None and scale is not None:
            guider = replace(guider, guidance_scale=scale)
        return guider if guider is not None and guider.active else None

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates the request; requests sharing every parameter but prompt, negative prompt and seed (and
        whether the prompt quotes text, which picks the guider) run together."""
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")
        sp = request.sampling_params
        if sp.true_cfg_scale is not None:
            raise OmniClientError(
                "HunyuanImage-2.1's guidance is guidance_scale (the guider's CFG scale, or the distilled model's "
                "embedded guidance); true_cfg_scale is not a HunyuanImage parameter",
                param="true_cfg_scale",
            )
        if sp.guidance_scale is not None and not self.distilled and self.guider is None and self.ocr_guider is None:
            raise OmniClientError("this checkpoint has no guider (guider/ in its repo) and no guidance embedding: "
                                  "guidance_scale has nothing to set", param="guidance_scale")
        guider = self.request_guider(request)
        if request.negative_prompt is not None and guider is None:
            why = "the distilled model runs no CFG" if self.distilled else "guidance_scale 1 turns CFG off"
            raise OmniClientError(f"negative_prompt is read only with classifier-free guidance ({why})",
                                  param="negative_prompt")
        for name in ("height", "width"):
            value = getattr(sp, name)
            if value is not None and value % self.size_multiple:
                raise OmniClientError(
                    f"{name} must be a multiple of {self.size_multiple} for HunyuanImage-2.1, got {value}", param=name
                )
        return (sp.height, sp.width, sp.num_inference_steps, sp.guidance_scale, sp.num_outputs_per_prompt,
                sp.output_type, guider)

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> HunyuanImageConditioning:
        """Latent grid, then the prompts and (CFG) their negatives ("" when a request has none) in one batch."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        guider = self.request_guider(requests[0])
        cfg = CFG(guider.guidance_scale) if guider else None
        texts = [text for text, _ in prompt_rows(requests, cfg)]
        embeds, lengths = self.encode_texts(texts)
        glyph, glyph_lengths = self.encode_glyphs(texts)
        lengths = tuple(m for m in lengths for _ in range(n))
        glyph_lengths = tuple(m for m in glyph_lengths for _ in range(n))
        if glyph is not None:
            glyph = glyph.repeat_interleave(n, dim=0)
        lh, lw = ((size or DEFAULT_SAMPLE_SIZE * self.vae_scale_factor) // self.vae_scale_factor
                  for size in (sp.height, sp.width))
        distilled = (DISTILLED_GUIDANCE if sp.guidance_scale is None else sp.guidance_scale) if self.distilled else None
        return HunyuanImageConditioning(embeds.repeat_interleave(n, dim=0), lengths, glyph, glyph_lengths, guider,
                                        cfg, distilled, (lh, lw))

    def prepare_latents(self, requests: list[OmniDiffusionRequest],
                        conditioning: HunyuanImageConditioning) -> torch.Tensor:
        """Noise in the model's dtype per request from its own CPU generator (diffusers' `randn_tensor`)."""
        noise = []
        for request in requests:
            sp = request.sampling_params
            generator = torch.Generator("cpu").manual_seed(shared_random_seed() if sp.seed is None else sp.seed)
            shape = (sp.num_outputs_per_prompt, self.transformer.in_channels, *conditioning.grid)
            noise.append(torch.randn(shape, generator=generator, dtype=self.dtype))
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh FlowMatchEulerDiscreteScheduler on diffusers' HunyuanImage sigmas (linear 1 -> 1/steps, the
        checkpoint's shift)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = requests[0].sampling_params.num_inference_steps or (DISTILLED_STEPS if self.distilled
                                                                   else DEFAULT_STEPS)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same latent grid and dtype; prompts (and their lengths), guidance, steps may differ."""
        return state.conditioning.grid, state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        h, w = cond.grid
        text = cond.embeds.shape[1] + (0 if cond.glyph is None else cond.glyph.shape[1])
        return self.transformer_rows(state) * (h * w + text)

    def step_cfg(self, state: DenoiseState) -> CFG | None:
        """CFG at the steps where the guider runs it (diffusers' `_is_cfg_enabled`)."""
        cond = state.conditioning
        if cond.guider is None or not cond.guider.cfg_at(state.step_index, len(state.timesteps)):
            return None
        return cond.cfg

    def step_inputs(self, state: DenoiseState) -> HunyuanImageStepInput:
        """The latent rows with their prompts (the negatives' under CFG); this step's timestep (and the next one
        for MeanFlow, the embedded guidance for the distilled model)."""
        cond, x = state.conditioning, state.latents
        num_rows = x.shape[0]
        i = state.step_index
        t = state.timesteps[i].expand(num_rows).to(self.dtype)
        timestep_r = None
        if self.transformer.use_meanflow:
            nxt = state.timesteps[i + 1] if i + 1 < len(state.timesteps) else state.timesteps.new_zeros(())
            timestep_r = nxt.expand(num_rows).to(self.dtype)
        guidance = None
        if cond.distilled_guidance is not None:
            guidance = torch.full((num_rows,), cond.distilled_guidance, dtype=self.dtype, device=x.device) * 1000.0
        return HunyuanImageStepInput(x, t, cond.embeds, cond.lengths, cond.glyph, cond.glyph_lengths, timestep_r,
                                     guidance)

    def transformer_forward(self, inp: HunyuanImageStepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call("transformer", inp.x, inp.timestep, inp.embeds, inp.lengths, inp.glyph, inp.glyph_lengths,
                    inp.timestep_r, inp.guidance)

    def combine_cfg(self, state: DenoiseState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """The request's guider (CFG, then adaptive projected guidance); its momentum buffer stays in the
        state."""
        conditioning = state.conditioning
        guided, conditioning.momentum = conditioning.guider.combine(state.step_index, len(state.timesteps), cond,
                                                                    uncond, conditioning.momentum)
        return guided

    def decode(self, state: DenoiseState) -> Any:
        output_type = state.requests[0].sampling_params.output_type
        if output_type == "latent":
            return list(state.latents.cpu())
        latents = state.latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        return list(self.image_processor.postprocess(image, output_type=output_type))

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Third-to-last hidden states of each templated prompt's real tokens after the template's first 34,
        zero-padded to the longest."""
        tokens = self.tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts], padding="longest", truncation=True,
                                max_length=MAX_PROMPT_TOKENS + DROP_TOKENS, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-3][:, DROP_TOKENS:]
        lengths = tuple(max(0, int(n) - DROP_TOKENS) for n in mask.sum(dim=1).tolist())
        if not min(lengths):
            raise OmniClientError("the prompt template left no prompt tokens", param="prompt")
        embeds = hidden[:, : max(lengths)] * mask[:, DROP_TOKENS : DROP_TOKENS + max(lengths), None].to(hidden.dtype)
        return embeds.to(self.dtype), lengths

    @torch.inference_mode()
    def encode_glyphs(self, prompts: list[str]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """ByT5 features of each prompt's quoted text (0 tokens for a prompt without), zero-padded."""
        if self.transformer.context_embedder_2 is None:
            return None, (0,) * len(prompts)
        glyphs = [glyph_text(p) for p in prompts]
        dim = self.text_encoder_2.config.d_model
        present = [g for g in glyphs if g is not None]
        if not present:
            return torch.zeros(len(prompts), 0, dim, dtype=self.dtype, device=self.device), (0,) * len(prompts)
        tokens = self.tokenizer_2(present, padding="longest", max_length=MAX_GLYPH_TOKENS, truncation=True,
                                  add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        hidden = self.text_encoder_2(input_ids=tokens.input_ids.to(self.device), attention_mask=mask.float())[0]
        hidden = hidden * mask[..., None].to(hidden.dtype)
        out = torch.zeros(len(prompts), hidden.shape[1], dim, dtype=self.dtype, device=self.device)
        lengths, j = [], 0
        for i, g in enumerate(glyphs):
            if g is None:
                lengths.append(0)
                continue
            out[i] = hidden[j].to(self.dtype)
            lengths.append(int(mask[j].sum()))
            j += 1
        return out, tuple(lengths)
