"""`/v1/audio/speech` model (OpenAI Audio API)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from vllm_omni.entrypoints.openai.protocol.common import CheckedBody


class SpeechRequest(CheckedBody):
    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, max_length=4096)
    model: str | None = None
    voice: str | dict[str, Any] | None = None
    instructions: str | None = Field(default=None, max_length=4096)
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "wav"
    """OpenAI's formats: wav (16-bit PCM in RIFF), raw 16-bit little-endian pcm, or mp3 / opus (in Ogg) / aac
    (ADTS) / flac encoded with PyAV. The default stays wav (OpenAI's is mp3): no encoder runs unless asked."""
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    """vllm-omni extension (as vLLM's chat `seed`): the sampling seed of every stage that samples (Qwen3-Omni's
    thinker and talker), so the same input, voice and seed give the same audio, streamed or not."""
    stream_format: Literal["audio", "sse"] | None = None
    """How the audio streams as it is made: "audio" (the default) the file's bytes by chunked transfer, "sse"
    `speech.audio.delta` / `speech.audio.done` events."""
