"""FLUX.1 text-to-image pipeline: CLIP + T5 prompt encoding, our MMDiT, flow-matching Euler, AutoencoderKL decode.

Numerically the same recipe as diffusers' `FluxPipeline` (same noise for the same seed, same sigmas and shift,
same guidance embedding), so images match it. Requests that share sampling params run as one batch; when true
CFG is on, positive and negative prompts go through the transformer as one batched forward.
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from vllm.utils.torch_utils import set_default_torch_dtype

from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig, set_current_attention_config
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.layers.compile import accelerate_if_requested
from vllm_omni.diffusion.model_loader.diffusers_loader import read_component_config
from vllm_omni.diffusion.model_loader.dummy import load_native_weights, load_pretrained
from vllm_omni.diffusion.timing import elapsed_since
from vllm_omni.logger import init_logger
from vllm_omni.models.flux.transformer import FluxTransformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

logger = init_logger(__name__)

DEFAULT_STEPS = 28
DEFAULT_GUIDANCE = 3.5
DEFAULT_MAX_SEQUENCE_LENGTH = 512


def calculate_shift(seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """Resolution-dependent timestep shift `mu` (linear in the number of image tokens)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * slope + base_shift - slope * base_seq_len


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 latent patches as tokens."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent grid of h x w."""
    b, _, c4 = latents.shape
    return latents.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def latent_image_ids(h2: int, w2: int) -> torch.Tensor:
    """(h2*w2, 3) positions (0, row, col) of the packed image tokens."""
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = torch.arange(h2)[:, None]
    ids[..., 2] = torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


class FluxPipeline(nn.Module):
    supports_request_batch: ClassVar[bool] = True

    def __init__(self, *, od_config: OmniDiffusionConfig, transformer: FluxTransformer2DModel, text_encoder,
                 text_encoder_2, tokenizer, tokenizer_2, vae, scheduler, device: torch.device, dtype: torch.dtype):
        super().__init__()
        from diffusers.image_processor import VaeImageProcessor

        self.od_config = od_config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.vae = vae
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.latent_channels = transformer.x_embedder.in_features // 4

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                        dtype: torch.dtype) -> FluxPipeline:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        model_dir = Path(model_dir)
        config = read_component_config(model_dir, "transformer")
        attn_config = DiffusionAttentionConfig(od_config.diffusion_attention_backend, od_config.fa_deterministic)
        with set_current_attention_config(attn_config), set_default_torch_dtype(dtype), torch.device(device):
            transformer = FluxTransformer2DModel.from_config(config)
        load_native_weights(transformer, model_dir, "transformer", od_config.load_format)
        transformer.eval()
        accelerate_if_requested(transformer, od_config, device)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        text_encoder = load(CLIPTextModel, model_dir / "text_encoder")
        text_encoder_2 = load(T5EncoderModel, model_dir / "text_encoder_2")
        vae = load(AutoencoderKL, model_dir / "vae")
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        return cls(od_config=od_config, transformer=transformer, text_encoder=text_encoder,
                   text_encoder_2=text_encoder_2, tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
                   tokenizer_2=AutoTokenizer.from_pretrained(model_dir / "tokenizer_2"), vae=vae,
                   scheduler=scheduler, device=device, dtype=dtype)

    @torch.inference_mode()
    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 hidden states (B, L, D), pooled CLIP embedding (B, P)), both padded to fixed lengths."""
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                  return_tensors="pt").input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        return embeds.to(self.text_encoder_2.dtype), pooled.to(self.text_encoder.dtype)

    @torch.inference_mode()
    def forward(self, batch: DiffusionRequestBatch) -> list[DiffusionOutput]:
        sp = batch.sampling_params
        n = sp.num_outputs_per_prompt
        height = sp.height or 128 * self.vae_scale_factor
        width = sp.width or 128 * self.vae_scale_factor
        # Latent grid: VAE downsampling, then rounded down to even so 2x2 patches tile it (as diffusers does).
        lh = 2 * (height // (self.vae_scale_factor * 2))
        lw = 2 * (width // (self.vae_scale_factor * 2))
        steps = sp.num_inference_steps or DEFAULT_STEPS
        true_cfg = sp.true_cfg_scale or 1.0
        cfg_rows = [i for i, r in enumerate(batch.requests) if true_cfg > 1 and r.negative_prompt is not None]
        durations: dict[str, float] = {}

        start = time.perf_counter()
        prompts = [r.prompt_text for r in batch.requests] + [batch.requests[i].negative_prompt for i in cfg_rows]
        embeds, pooled = self.encode_prompt(prompts, sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)
        embeds, pooled = embeds.repeat_interleave(n, dim=0), pooled.repeat_interleave(n, dim=0)
        durations["text_encoder"] = elapsed_since(start, self.device)

        start = time.perf_counter()
        latents = torch.cat([self._initial_noise(r.sampling_params.seed, n, lh, lw) for r in batch.requests])
        latents = pack_latents(latents.to(self.device))
        neg_rows = torch.tensor([i * n + j for i in cfg_rows for j in range(n)], device=self.device, dtype=torch.long)
        timesteps, sigmas = self._schedule(steps, latents.shape[1])
        guidance = None
        if self.transformer.guidance_embeds:
            scale = DEFAULT_GUIDANCE if sp.guidance_scale is None else sp.guidance_scale
            guidance = torch.full((embeds.shape[0],), scale, device=self.device, dtype=torch.float32)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        img_ids = latent_image_ids(lh // 2, lw // 2).to(self.device, self.dtype)
        rope = self.transformer.rotary_emb(txt_ids, img_ids)
        # Every step's adaLN parameters at once, from the timesteps exactly as each step passes them.
        step_timesteps = timesteps[:, None].expand(-1, embeds.shape[0]).to(latents.dtype) / 1000
        modulation = self.transformer.step_modulation(step_timesteps, guidance, pooled, self.dtype)
        for i in tqdm(range(steps), disable=not self.od_config.enable_progress_bar, desc="denoise"):
            model_in = torch.cat([latents, latents.index_select(0, neg_rows)]) if len(cfg_rows) else latents
            pred = self.transformer(model_in, embeds, pooled, step_timesteps[i], guidance=guidance, rotary_emb=rope,
                                    modulation=self.transformer.step_slice(modulation, i))
            if len(cfg_rows):
                pred, neg = pred[: latents.shape[0]], pred[latents.shape[0]:]
                pos = pred.index_select(0, neg_rows)
                pred = pred.index_copy(0, neg_rows, neg + true_cfg * (pos - neg))
            # Flow-matching Euler step in float32, as FlowMatchEulerDiscreteScheduler.step does.
            latents = (latents.float() + (sigmas[i + 1] - sigmas[i]) * pred).to(pred.dtype)
        durations["denoise"] = elapsed_since(start, self.device)

        start = time.perf_counter()
        images = self._decode(latents, lh, lw, sp.output_type)
        durations["vae_decode"] = elapsed_since(start, self.device)
        return [DiffusionOutput(output=images[i * n:(i + 1) * n], stage_durations=dict(durations))
                for i in range(len(batch))]

    def _initial_noise(self, seed: int | None, n: int, lh: int, lw: int) -> torch.Tensor:
        """Gaussian latents from a CPU generator, the way diffusers' randn_tensor draws them for one prompt."""
        generator = torch.Generator(device="cpu").manual_seed(random.getrandbits(63) if seed is None else seed)
        return torch.randn((n, self.latent_channels, lh, lw), generator=generator, dtype=self.dtype)

    def _schedule(self, steps: int, image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = None if cfg.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        self.scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas, mu=mu)
        return self.scheduler.timesteps, self.scheduler.sigmas

    def _decode(self, latents: torch.Tensor, lh: int, lw: int, output_type: str) -> list[Any]:
        if output_type == "latent":
            return list(latents.cpu())
        latents = unpack_latents(latents, lh, lw)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        out = self.image_processor.postprocess(image, output_type=output_type)
        return list(out)
