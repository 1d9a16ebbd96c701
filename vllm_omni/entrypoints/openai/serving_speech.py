"""`/v1/audio/speech` on pipelines whose final stage produces audio (OpenAI Audio API).

The audio streams as the pipeline makes it (`stream_format`): "audio" (the default, as OpenAI's) sends the file's
bytes by chunked transfer (a WAV starts with a header of unknown length unless the first chunk is the whole
audio), "sse" sends `speech.audio.delta` events (base64 bytes of the same file) and one `speech.audio.done`.
Nothing is sent before the first audio chunk exists, so a failed request is still an HTTP error status. WAV and
raw PCM stream chunk by chunk; mp3 / opus / aac / flac (PyAV) are encoded once the waveform is complete.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from vllm.utils import random_uuid

from vllm_omni.entrypoints.openai.audio_stream import AudioStreamEncoder, audio_chunk, sample_rate
from vllm_omni.entrypoints.openai.errors import exception_to_response
from vllm_omni.entrypoints.openai.media import AUDIO_FORMATS, encode_audio
from vllm_omni.entrypoints.openai.protocol.audio import SpeechRequest
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase, fail_fast, maybe_await
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

STREAMED_FORMATS = frozenset({"wav", "pcm"})
"""Response formats sent chunk by chunk as the audio is made; the others need the whole waveform."""


def seeded(params: Any, seed: int) -> Any:
    """A copy of a stage's params with `seed`, for the stages that sample (vLLM `SamplingParams`, diffusion
    params); a stage without sampling (the vocoder: None) is deterministic and kept as it is."""
    if params is None or not hasattr(params, "seed"):
        return params
    params = copy.copy(params)
    params.seed = seed
    return params


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
        params = self.build_sampling_params_list()
        if request.seed is not None:
            params = [seeded(p, request.seed) for p in params]
        outputs = self.generate(prompt, f"speech-{random_uuid()}", params)
        if request.stream_format == "sse":
            return StreamingResponse(await fail_fast(self.sse_events(request, outputs)),
                                     media_type="text/event-stream")
        return StreamingResponse(await fail_fast(self.raw_audio(request, outputs)),
                                 media_type=AUDIO_FORMATS[request.response_format][2])

    async def raw_audio(self, request: SpeechRequest, outputs: AsyncIterator[OmniRequestOutput]
                        ) -> AsyncIterator[bytes]:
        sent = False
        try:
            async for data in self.audio_bytes(request, outputs):
                sent = True
                yield data
        except Exception:
            if not sent:
                raise
            # The status line is gone: the body ends short (the client sees a truncated file).
            logger.warning("speech stream failed after its first chunk", exc_info=True)

    async def audio_bytes(self, request: SpeechRequest, outputs: AsyncIterator[OmniRequestOutput],
                          usage: dict[str, int] | None = None) -> AsyncIterator[bytes]:
        """The audio file's bytes, a chunk at a time; `usage` gets the text stage's token counts. WAV and PCM
        stream chunk by chunk; the compressed formats (mp3, opus, aac, flac: PyAV) are encoded once the whole
        waveform exists, and come as one chunk."""
        encoder = AudioStreamEncoder(request.response_format)
        async for output in outputs:
            samples = audio_chunk(output)
            if samples is None:
                if usage is not None and output.request_output is not None:
                    usage["input_tokens"] = len(output.request_output.prompt_token_ids or [])
                    usage["output_tokens"] = len(output.token_ids)
                continue
            if request.response_format in STREAMED_FORMATS:
                yield encoder.encode(samples, sample_rate(output), last=output.stage_finished)
            elif output.stage_finished:
                encoder.started = True
                yield await asyncio.to_thread(encode_audio, output.multimodal_output["audio"], sample_rate(output),
                                              request.response_format)
        if not encoder.started:
            raise OmniClientError(f"`{self.model_name}` returned no audio for this request", status_code=422)

    async def sse_events(self, request: SpeechRequest, outputs: AsyncIterator[OmniRequestOutput]
                         ) -> AsyncIterator[str]:
        """`speech.audio.done` reports the text stage's tokens: the prompt's as input, the spoken answer's as
        output."""
        usage = {"input_tokens": 0, "output_tokens": 0}
        sent = False
        try:
            async for data in self.audio_bytes(request, outputs, usage):
                sent = True
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as exc:
            if not sent:
                raise
            yield f"data: {exception_to_response(exc).body.decode()}\n\n"  # the status is sent: an event
            return
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"

    async def speech_prompt(self, request: SpeechRequest) -> str:
        """A pipeline that starts with a chat model (e.g. Qwen3-Omni's thinker) speaks its answer to `input`,
        so `input` becomes a user turn (with `instructions` as the system turn) under the chat template; a
        text-to-speech model (Qwen3-TTS) speaks `input` itself (its `instructions` describe the voice)."""
        if not self.capabilities.starts_with_ar or self.capabilities.speaks_input:
            return request.input
        tokenizer = await maybe_await(self.engine.get_tokenizer())
        if not getattr(tokenizer, "chat_template", None):
            raise OmniClientError(f"`{self.model_name}` has no chat template to turn `input` into a prompt",
                                  param="input")
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        messages.append({"role": "user", "content": request.input})
        return await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                       add_generation_prompt=True)  # off the event loop, like chat
