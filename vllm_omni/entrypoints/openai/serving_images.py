"""`/v1/images/generations` and `/v1/images/edits` on diffusion pipelines (OpenAI Images API)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from vllm.utils import random_uuid

from vllm_omni.entrypoints.openai.errors import exception_to_response
from vllm_omni.entrypoints.openai.media import decode_image_async, encode_image_b64, probe_image
from vllm_omni.entrypoints.openai.protocol.images import (
    ImageData,
    ImageGenerationRequest,
    ImageGenStreamEvent,
    ImagesResponse,
)
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase, fail_fast
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

_NO_USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
             "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}


class OmniOpenAIServingImages(OmniServingBase):
    async def generate_images(self, request: ImageGenerationRequest) -> ImagesResponse:
        if request.partial_images:
            raise OmniClientError("partial_images needs stream=true", param="partial_images")
        return await self._run(request, self._params(request), images=[])

    async def stream_images(self, request: ImageGenerationRequest) -> StreamingResponse:
        """OpenAI's image streaming: `partial_images` previews, then the final image, as SSE events. What fails
        before the first event is the HTTP status; a later failure is an `error` event."""
        if request.num_images != 1:
            raise OmniClientError("stream=true generates one image (n=1)", param="n")
        params = [dataclasses.replace(p, stream_partial_outputs=True, partial_images=request.partial_images or 0)
                  if isinstance(p, OmniDiffusionSamplingParams) else p for p in self._params(request)]
        events = self._events(request, {"prompt": request.prompt, **self._negative(request)}, params)
        return StreamingResponse(await fail_fast(events), media_type="text/event-stream")

    async def _events(self, request: ImageGenerationRequest, prompt: dict[str, Any], params: list[Any]
                      ) -> AsyncIterator[str]:
        sent_any = False
        request_id = f"img-{random_uuid()}"
        self.log_user(request_id, request.user)
        try:
            async for output in self.generate(prompt, request_id, params):
                partial = None if output.finished else output.multimodal_output.get("partial_image")
                images = output.images if output.finished else (partial or {}).get("images", [])
                for image in images:
                    event = await asyncio.to_thread(self._event, image, request, partial)
                    sent_any = True
                    yield f"event: {event.type}\ndata: {event.model_dump_json(exclude_none=True)}\n\n"
        except Exception as exc:
            if not sent_any:
                raise
            yield f"event: error\ndata: {exception_to_response(exc).body.decode()}\n\n"

    @staticmethod
    def _event(image: Any, request: ImageGenerationRequest, partial: dict[str, Any] | None) -> ImageGenStreamEvent:
        kind = "image_generation.completed" if partial is None else "image_generation.partial_image"
        return ImageGenStreamEvent(
            type=kind, b64_json=encode_image_b64(image, request.output_format), created_at=int(time.time()),
            output_format=request.output_format, size=f"{image.width}x{image.height}",
            partial_image_index=None if partial is None else partial["index"],
            usage=_NO_USAGE if partial is None else None)

    @staticmethod
    def _negative(request: ImageGenerationRequest) -> dict[str, Any]:
        return {} if request.negative_prompt is None else {"negative_prompt": request.negative_prompt}

    async def edit_images(self, request: ImageGenerationRequest, uploads: list[tuple[str, bytes]]
                          ) -> ImagesResponse:
        if not uploads:
            raise OmniClientError("image is required (one or more image files)", param="image")
        if request.stream or request.partial_images:
            raise OmniClientError("streaming is available on /v1/images/generations only", param="stream")
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
        prompt: dict[str, Any] = {"prompt": request.prompt, **self._negative(request)}
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        request_id = f"img-{random_uuid()}"
        self.log_user(request_id, request.user)
        finals = await self.generate_final(prompt, request_id, params)
        outputs = [img for o in finals for img in o.images]
        if not outputs:
            raise OmniClientError(f"`{self.model_name}` returned no image for this request", status_code=422)
        durations = {k: v for o in finals for k, v in o.stage_durations.items()}
        data = await asyncio.to_thread(lambda: [self._image_data(img, request) for img in outputs])  # PNG encoding
        return ImagesResponse(data=data, output_format=request.output_format, stage_durations=durations or None,
                              cache=next((o.cache for o in finals if o.cache is not None), None))

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
