"""`/v1/images/generations` and `/v1/images/edits` on diffusion pipelines (OpenAI Images API)."""

from __future__ import annotations

from typing import Any

from vllm.utils import random_uuid

from vllm_omni.entrypoints.openai.media import decode_image_bytes, encode_image_b64
from vllm_omni.entrypoints.openai.protocol.images import ImageData, ImageGenerationRequest, ImagesResponse
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase
from vllm_omni.errors import OmniClientError


class OmniOpenAIServingImages(OmniServingBase):
    async def generate_images(self, request: ImageGenerationRequest) -> ImagesResponse:
        return await self._run(request, images=[])

    async def edit_images(self, request: ImageGenerationRequest, uploads: list[tuple[str, bytes]]
                          ) -> ImagesResponse:
        if not uploads:
            raise OmniClientError("image is required (one or more image files)", param="image")
        images = []
        for name, data in uploads:
            if len(data) > self.limits.max_upload_bytes:
                raise OmniClientError(
                    f"{name} is {len(data)} bytes, over the {self.limits.max_upload_bytes} byte upload limit "
                    "(see --max-upload-mb)",
                    status_code=413, param=name,
                )
            images.append(decode_image_bytes(data, name))
        if not self.capabilities.supports_edits:
            raise OmniClientError(f"/v1/images/edits needs a model that takes an input image and outputs images; "
                                  f"`{self.model_name}` {self.capabilities.describe()} (use /v1/images/generations)",
                                  param="image")
        return await self._run(request, images=images)

    async def _run(self, request: ImageGenerationRequest, images: list[Any]) -> ImagesResponse:
        self.check_model(request.model)
        self.require_output("image", "the images API")
        if request.num_outputs_per_prompt is not None and request.num_outputs_per_prompt != request.n:
            raise OmniClientError("give n or num_outputs_per_prompt, not both", param="num_outputs_per_prompt")
        self.check_num_outputs(request.n, "n")
        request.num_outputs_per_prompt = request.n
        prompt: dict[str, Any] = {"prompt": request.prompt}
        if request.negative_prompt is not None:
            prompt["negative_prompt"] = request.negative_prompt
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        params = self.build_sampling_params_list(diffusion_fields=request)
        finals = await self.generate_final(prompt, f"img-{random_uuid()}", params)
        outputs = [img for o in finals for img in o.images]
        if not outputs:
            raise OmniClientError(f"`{self.model_name}` returned no image for this request", status_code=422)
        durations = {k: v for o in finals for k, v in o.stage_durations.items()}
        return ImagesResponse(data=[self._image_data(img, request) for img in outputs],
                              output_format=request.output_format, stage_durations=durations or None)

    @staticmethod
    def _image_data(image: Any, request: ImageGenerationRequest) -> ImageData:
        b64 = encode_image_b64(image, request.output_format)
        if request.response_format == "url":
            return ImageData(url=f"data:image/{request.output_format};base64,{b64}")
        return ImageData(b64_json=b64)
