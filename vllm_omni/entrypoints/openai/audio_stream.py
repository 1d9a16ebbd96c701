"""Audio that leaves the server chunk by chunk (chat `delta.audio`, `/v1/audio/speech` streams).

A streamed stage's outputs carry their own samples as `multimodal_output["audio_chunk"]` (the last one also the
whole waveform as `audio`); a non-streamed stage's one output carries both. `AudioStreamEncoder` turns those
chunks into bytes whose concatenation is one file: raw 16-bit PCM, or one WAV stream.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from vllm_omni.entrypoints.openai.media import audio_to_pcm16, encode_wav, num_channels
from vllm_omni.outputs import OmniRequestOutput

_UNKNOWN_SIZE = 0xFFFFFFFF
"""RIFF / data sizes of a WAV whose length is not known when its header is sent (as WAV over a pipe)."""


def audio_chunk(output: OmniRequestOutput) -> Any | None:
    """The samples this output adds to the request's audio (None: it carries no audio)."""
    media = output.multimodal_output
    return media.get("audio_chunk", media.get("audio"))


def sample_rate(output: OmniRequestOutput) -> int:
    return int(output.multimodal_output.get("sample_rate") or 24000)


def streaming_wav_header(sample_rate: int, channels: int = 1) -> bytes:
    """The 44-byte header of a 16-bit PCM WAV of unknown length."""
    block = channels * 2
    return (b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16) +
            b"data" + struct.pack("<I", _UNKNOWN_SIZE))


class AudioStreamEncoder:
    """Bytes of each chunk in `fmt` ("wav" or "pcm"/"pcm16"): a WAV stream starts with its header, with the exact
    sizes when the first chunk is also the last (the whole audio), else the unknown-length marker."""

    def __init__(self, fmt: str) -> None:
        self.wav = fmt == "wav"
        self.started = False

    def encode(self, samples: Any, rate: int, last: bool) -> bytes:
        first, self.started = not self.started, True
        if not self.wav:
            return audio_to_pcm16(samples)
        if first and last:
            return encode_wav(samples, rate)
        header = streaming_wav_header(rate, num_channels(samples)) if first else b""
        return header + audio_to_pcm16(samples)


class AudioDeltas:
    """The `delta.audio` chunks of one streamed answer, in OpenAI's shape: one `id`; each chunk's audio as base64
    in the requested format (their concatenation is one file); the transcript text that appeared since the
    previous chunk (so the transcripts add up to the answer); the last audio chunk also `expires_at`."""

    def __init__(self, fmt: str, ttl_s: int) -> None:
        self.id = f"audio-{uuid.uuid4().hex}"
        self.ttl_s = ttl_s
        self.encoder = AudioStreamEncoder(fmt)
        self.transcript_sent = 0

    def delta(self, output: OmniRequestOutput, samples: Any, transcript: str) -> dict[str, Any]:
        data = self.encoder.encode(samples, sample_rate(output), last=output.stage_finished)
        delta = {"id": self.id, "data": base64.b64encode(data).decode("ascii"),
                 "transcript": transcript[self.transcript_sent:]}
        self.transcript_sent = len(transcript)
        if output.stage_finished:
            delta["expires_at"] = int(time.time()) + self.ttl_s
        return delta

    def rest(self, transcript: str) -> dict[str, Any] | None:
        """Text written after the audio ended (the talker stopped at its `max_tokens` first), as one last delta
        without data, so the transcripts still add up to the answer; None when nothing is left."""
        if not self.encoder.started or len(transcript) <= self.transcript_sent:
            return None
        delta = {"id": self.id, "transcript": transcript[self.transcript_sent:]}
        self.transcript_sent = len(transcript)
        return delta
