"""Wan image-to-video (Wan2.1 I2V, Wan2.2 A14B I2V, Wan2.2 TI2V 5B): the T2V pipeline plus first-frame conditioning.

Reference spec: diffusers `WanImageToVideoPipeline.__call__`. On top of text-to-video:
  - the input image (prompt `multi_modal_data["image"]`) is resized to the output size and VAE-encoded as
    the first frame of an otherwise black clip; its normalized latents plus a 4-channel first-frame mask are
    concatenated to the noisy latents (16 + 4 + 16 = 36 DiT input channels),
  - when the checkpoint has a CLIP `image_encoder` (Wan2.1 I2V), its penultimate hidden states feed the DiT's
    image cross-attention branch;
  - Wan2.2 TI2V (`expand_timesteps`) instead VAE-encodes the image alone and pins the first latent frame to it,
    with timestep 0 on those tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.timing import elapsed_since
from vllm_omni.errors import OmniClientError
from vllm_omni.models.wan.pipeline import WanConditioning, WanGeometry, WanPipeline

if TYPE_CHECKING:
    from PIL import Image

    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.state import DenoiseState
    from vllm_omni.diffusion.step_context import StepContext


def _request_image(request: OmniDiffusionRequest) -> Image.Image:
    from PIL import Image

    image = request.multi_modal_data.get("image")
    if isinstance(image, list | tuple):
        if len(image) != 1:
            raise OmniClientError(f"image-to-video takes exactly one image, got {len(image)}", param="image")
        image = image[0]
    if not isinstance(image, Image.Image):
        raise OmniClientError("image-to-video needs multi_modal_data['image'] as a PIL image", param="image")
    return image.convert("RGB")


class WanImageToVideoPipeline(WanPipeline):
    """Image-to-video for Wan2.1 I2V (CLIP image tokens + first-frame latents) and Wan2.2 A14B I2V."""

    def __init__(self, *, image_encoder: Any = None, image_processor: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_encoder = image_encoder
        self.image_processor = image_processor
        from diffusers.video_processor import VideoProcessor

        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_spatial)

    @classmethod
    def _load_components(cls, od_config: OmniDiffusionConfig, model_dir: Path, index: dict[str, Any],
                         device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        components = super()._load_components(od_config, model_dir, index, device, dtype)
        if components["transformer"].config.image_dim is not None:
            from transformers import CLIPImageProcessor, CLIPVisionModel

            from vllm_omni.diffusion.model_loader.dummy import load_pretrained

            components["image_encoder"] = load_pretrained(CLIPVisionModel, model_dir / "image_encoder", device=device,
                                                          dtype=torch.float32, load_format=od_config.load_format)
            components["image_processor"] = CLIPImageProcessor.from_pretrained(model_dir / "image_processor")
        return components

    def validate_request(self, request: OmniDiffusionRequest) -> None:
        super().validate_request(request)
        _request_image(request)

    def prepare(self, requests: list[OmniDiffusionRequest], ctx: StepContext) -> DenoiseState:
        """The text-to-video preparation plus the images' conditioning: CLIP tokens (when the checkpoint has an
        image encoder) and VAE latents of the first frame."""
        state = super().prepare(requests, ctx)
        cond: WanConditioning = state.conditioning
        per_prompt = state.outputs_per_request
        images = [_request_image(r) for r in requests]
        start = time.perf_counter()
        if self.image_encoder is not None:
            pixels = self.image_processor(images=images, return_tensors="pt").to(self.device)
            hidden = self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]
            cond.image_embeds = hidden.to(self.dtype).repeat_interleave(per_prompt, dim=0)
            state.durations["image_encoder"] = elapsed_since(start, self.device)
            start = time.perf_counter()
        if self.expand_timesteps:
            latents, cond.first_frame_mask = self.encode_first_frame_latents(images, cond.geometry)
        else:
            latents = self.encode_first_frames(images, cond.geometry)
        cond.latents = latents.repeat_interleave(per_prompt, dim=0)
        state.durations["vae_encode"] = elapsed_since(start, self.device)
        return state

    def _preprocess(self, images: list[Image.Image], geometry: WanGeometry) -> torch.Tensor:
        return torch.cat([self.video_processor.preprocess(img, height=geometry.height, width=geometry.width)
                          for img in images]).to(self.device, torch.float32)

    def encode_first_frame_latents(self, images: list[Image.Image], geometry: WanGeometry
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Wan2.2 TI2V: latents of the image alone (n, z, 1, h, w) and the (1, 1, T, h, w) first-frame mask."""
        clip = self._preprocess(images, geometry).unsqueeze(2)
        latent = self.vae.encode(clip.to(self.vae.dtype)).latent_dist.mode()
        latent = self.normalize_latents(latent.to(torch.float32), inverse=False)
        mask = torch.ones(1, 1, geometry.latent_frames, geometry.latent_height, geometry.latent_width,
                          device=self.device)
        mask[:, :, 0] = 0
        return latent, mask

    def encode_first_frames(self, images: list[Image.Image], geometry: WanGeometry) -> torch.Tensor:
        """(n, 4 + 16, T, h, w): first-frame mask channels and the VAE latents of [image, black frames...]."""
        first = self._preprocess(images, geometry)
        n = first.shape[0]
        clip = torch.cat([first.unsqueeze(2), first.new_zeros(n, 3, geometry.num_frames - 1, geometry.height,
                                                              geometry.width)], dim=2)
        latent = self.vae.encode(clip.to(self.vae.dtype)).latent_dist.mode()
        latent = self.normalize_latents(latent.to(torch.float32), inverse=False)
        # One mask channel per video frame, folded into groups of `vae_scale_temporal` per latent frame; the
        # first frame counts `vae_scale_temporal` times so the groups line up with the VAE's causal stride.
        frame_mask = torch.zeros(n, 1, geometry.num_frames, geometry.latent_height, geometry.latent_width,
                                 device=self.device)
        frame_mask[:, :, 0] = 1
        frame_mask = torch.cat([frame_mask[:, :, :1].repeat_interleave(self.vae_scale_temporal, dim=2),
                                frame_mask[:, :, 1:]], dim=2)
        mask = frame_mask.view(n, -1, self.vae_scale_temporal, geometry.latent_height,
                               geometry.latent_width).transpose(1, 2)
        return torch.cat([mask, latent], dim=1)
