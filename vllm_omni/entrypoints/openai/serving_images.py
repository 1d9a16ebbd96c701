"""`/v1/images/generations` and `/v1/images/edits` on diffusion pipelines (OpenAI Images API)."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm.utils import random_uuid

from vllm_omni.entrypoints.openai.media import decode_image_async, encode_image_b64, probe_image
from vllm_omni.entrypoints.openai.protocol.images import ImageData, ImageGenerationRequest, ImagesResponse
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase
from vllm_omni.errors import OmniClientError


class OmniOpenAIServingImages(OmniServingBase):
    async def generate_images(self, request: ImageGenerationRequest) -> ImagesResponse:
        return await self._run(request, self._params(request), images=[])

    async def edit_images(self, request: ImageGenerationRequest, uploads: list[tuple[str, bytes]]
                          ) -> ImagesResponse:
        if not uploads:
            raise OmniClientError("image is required (one or more image files)", param="image")
        for name, data in uploads:
            if len(data) > self.limits.max_upload_bytes:
                raise OmniClientError(
                    f"{name} is {len(data)} bytes, over the {self.limits.max_upload_bytes} byte upload limit "
                    "(see --max-upload-mb)",
                    status_code=413, param=name,
                )
            probe_image(data, name, self.limits.max_input_image_pixels)  # header only: says what was sent
        if not self.capabilities.supports_edits:
            raise OmniClientError(f"/v1/images/edits needs a model that takes an input image and outputs images; "
                                  f"`{self.model_name}` {self.capabilities.describe()} (use /v1/images/generations)",
                                  param="image")
        params = self._params(request)  # every check before the images are decoded
        images = [await decode_image_async(data, name, self.limits.max_input_image_pixels) for name, data in uploads]
        return await self._run(request, params, images)

    async def _run(self, request: ImageGenerationRequest, params: list[Any], images: list[Any]) -> ImagesResponse:
        prompt: dict[str, Any] = {"prompt": request.prompt}
        if request.negative_prompt is not None:
            prompt["negative_prompt"] = request.negative_prompt
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        finals = await self.generate_final(prompt, f"img-{random_uuid()}", params)
        outputs = [img for o in finals for img in o.images]
        if not outputs:
            raise OmniClientError(f"`{self.model_name}` returned no image for this request", status_code=422)
        durations = {k: v for o in finals for k, v in o.stage_durations.items()}
        data = await asyncio.to_thread(lambda: [self._image_data(img, request) for img in outputs])  # PNG encoding
        return ImagesResponse(data=data,
                              output_format=request.output_format, stage_durations=durations or None)

    def _params(self, request: ImageGenerationRequest) -> list[Any]:
        self.check_model(request.model)
        self.require_output("image", "the images API")
        n = request.num_images
        self.check_num_outputs(n, "n" if request.n is not None else "num_outputs_per_prompt")
        request.num_outputs_per_prompt = n
        return self.build_sampling_params_list(diffusion_fields=request)

    @staticmethod
    def _image_data(image: Any, request: ImageGenerationRequest) -> ImageData:
        quality = None if request.output_compression is None else 100 - request.output_compression
        b64 = encode_image_b64(image, request.output_format, quality=quality)
        if request.response_format == "url":
            return ImageData(url=f"data:image/{request.output_format};base64,{b64}")
        return ImageData(b64_json=b64)
