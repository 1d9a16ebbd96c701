"""Qwen-Image-Edit: the Qwen-Image pipeline conditioned on an input image.

The input image is resized to about one megapixel at its own aspect ratio, then used twice: the
Qwen2.5-VL encoder sees it with the instruction (vision tokens in the prompt), and its VAE latents are
appended to the generated image's tokens in every transformer row (the prediction for them is dropped).
Matches diffusers' `QwenImageEditPipeline` for the same weights and seed.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import torch

from vllm_omni.diffusion.pipeline_base import prompt_rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import DenoiseState
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.timing import elapsed_since
from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen_image.pipeline import QwenConditioning, QwenImagePipeline

CONDITION_AREA = 1024 * 1024
IMAGE_PAD = "<|image_pad|>"


def condition_size(image_width: int, image_height: int) -> tuple[int, int]:
    """(width, height) of about CONDITION_AREA pixels at the image's aspect ratio, multiples of 32."""
    ratio = image_width / image_height
    width = math.sqrt(CONDITION_AREA * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


class QwenImageEditPipeline(QwenImagePipeline):
    prompt_template: ClassVar[str] = (
        "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
        "background), then explain how the user's text instruction should alter or modify the image. Generate a "
        "new image that meets the user's requirements while maintaining consistency with the original input "
        "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt_template_drop_tokens: ClassVar[int] = 64

    @classmethod
    def needs_processor(cls) -> bool:
        return True

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        image = self.input_image(request)
        return super().group_key(request), condition_size(*image.size)

    @staticmethod
    def input_image(request: OmniDiffusionRequest) -> Any:
        from PIL import Image

        image = request.multi_modal_data.get("image")
        if isinstance(image, list | tuple):
            if len(image) != 1:
                raise OmniClientError(f"Qwen-Image-Edit takes exactly one input image, got {len(image)}",
                                      param="image")
            image = image[0]
        if not isinstance(image, Image.Image):
            raise OmniClientError("Qwen-Image-Edit needs an input image (multi_modal_data.image)", param="image")
        return image.convert("RGB")

    def condition_images(self, requests: list[OmniDiffusionRequest]) -> tuple[list[Any], int, int]:
        """Each request's input image resized to the condition size of the first (the group shares it)."""
        images = [self.input_image(r) for r in requests]
        cond_w, cond_h = condition_size(*images[0].size)
        return [self.image_processor.resize(image, cond_h, cond_w) for image in images], cond_w, cond_h

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> QwenConditioning:
        """Instruction + input image (and the negative with the same image) in one text-encoder batch; the
        output size defaults to the condition size, whose 2x2-patch grid follows the generated image's."""
        sp = requests[0].sampling_params
        images, cond_w, cond_h = self.condition_images(requests)
        geometry = self.resolve_geometry(sp, default_hw=(cond_h, cond_w))
        multiple = self.vae_scale_factor * 2
        geometry.img_shapes.append((1, cond_h // multiple, cond_w // multiple))
        cfg = self.true_cfg(requests[0])
        rows = prompt_rows(requests, cfg)
        # Edit prompts are not truncated to max_sequence_length (as in diffusers).
        prompt = self.encode_texts([text for text, _ in rows], None, sp.num_outputs_per_prompt,
                                   images=[images[i] for _, i in rows])
        return QwenConditioning(prompt, geometry, cfg)

    def prepare(self, requests: list[OmniDiffusionRequest], ctx: StepContext) -> DenoiseState:
        """Qwen-Image's preparation plus the input image's VAE latents, appended to every row's tokens."""
        state = super().prepare(requests, ctx)
        start = time.perf_counter()
        images, cond_w, cond_h = self.condition_images(requests)
        per_prompt = requests[0].sampling_params.num_outputs_per_prompt
        state.conditioning.image_latents = self.encode_condition(images, cond_h, cond_w, per_prompt)
        state.durations["vae_encode"] = elapsed_since(start, self.device)
        return state

    def text_encoder_inputs(self, texts: list[str], images: list[Any] | None = None) -> dict[str, torch.Tensor]:
        """What Qwen2VLProcessor produces: pixel patches + each image's pad token repeated per merged patch."""
        vision = self.vl_image_processor(images=images, return_tensors="pt")
        merge = self.vl_image_processor.merge_size**2
        formatted = []
        for text, grid in zip(texts, vision["image_grid_thw"], strict=True):
            prompt = self.prompt_template.format(text)
            formatted.append(prompt.replace(IMAGE_PAD, IMAGE_PAD * int(grid.prod() // merge), 1))
        tokens = self.tokenizer(formatted, padding=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask,
                "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    def encode_condition(self, images: list[Any], height: int, width: int, per_prompt: int) -> torch.Tensor:
        """Packed, normalized VAE latents (mode of the posterior) of each request's resized input image."""
        pixels = self.image_processor.preprocess(images, height, width).unsqueeze(2)
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()
        latents = self.normalize_latents(latents, inverse=False)
        packed = self.pack_latents(latents[:, :, 0])
        return packed.repeat_interleave(per_prompt, dim=0)
