"""`/v1/audio/speech` on pipelines whose final stage produces audio (OpenAI Audio API)."""

from __future__ import annotations

import asyncio

from fastapi.responses import Response
from vllm.utils import random_uuid

from vllm_omni.entrypoints.openai.media import AUDIO_FORMATS, encode_audio
from vllm_omni.entrypoints.openai.protocol.audio import SpeechRequest
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase, maybe_await
from vllm_omni.errors import OmniClientError


class OmniOpenAIServingSpeech(OmniServingBase):
    async def create_speech(self, request: SpeechRequest) -> Response:
        self.check_model(request.model)
        self.require_output("audio", "/v1/audio/speech")
        if request.speed != 1.0:
            raise OmniClientError("speed other than 1.0 is not supported yet", param="speed")
        prompt = {"prompt": await self.speech_prompt(request)}
        if request.instructions:
            prompt["instructions"] = request.instructions
        if request.voice is not None:
            prompt["voice"] = request.voice
        finals = await self.generate_final(prompt, f"speech-{random_uuid()}", self.build_sampling_params_list())
        output = next((o for o in finals if "audio" in o.multimodal_output), None)
        if output is None:
            raise OmniClientError(f"`{self.model_name}` returned no audio for this request", status_code=422)
        audio = output.multimodal_output["audio"]
        rate = int(output.multimodal_output.get("sample_rate", 24000))
        body = await asyncio.to_thread(encode_audio, audio, rate, request.response_format)
        return Response(body, media_type=AUDIO_FORMATS[request.response_format][2])

    async def speech_prompt(self, request: SpeechRequest) -> str:
        """A pipeline that starts with a chat model (e.g. Qwen3-Omni's thinker) speaks its answer to `input`,
        so `input` becomes a user turn (with `instructions` as the system turn) under the chat template."""
        if not self.capabilities.starts_with_ar:
            return request.input
        tokenizer = await maybe_await(self.engine.get_tokenizer())
        if not getattr(tokenizer, "chat_template", None):
            raise OmniClientError(f"`{self.model_name}` has no chat template to turn `input` into a prompt",
                                  param="input")
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        messages.append({"role": "user", "content": request.input})
        return await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                       add_generation_prompt=True)  # off the event loop, like chat
