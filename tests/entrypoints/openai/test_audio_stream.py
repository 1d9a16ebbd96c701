"""Streamed audio bytes: chunks concatenated are one file (raw PCM16, or one WAV stream whose header says
"unknown length" unless the first chunk is the whole audio); chat `delta.audio` chunks share an id, their
transcripts add up to the text and only the last has `expires_at`."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np

from vllm_omni.entrypoints.openai.audio_stream import AudioDeltas, AudioStreamEncoder
from vllm_omni.entrypoints.openai.media import audio_to_pcm16, encode_wav
from vllm_omni.outputs import OmniRequestOutput

CHUNKS = [np.linspace(-1, 1, n, dtype=np.float32) for n in (480, 240, 100)]


def test_wav_stream_is_one_file_with_unknown_length():
    encoder = AudioStreamEncoder("wav")
    data = b"".join(encoder.encode(c, 24000, last=i == len(CHUNKS) - 1) for i, c in enumerate(CHUNKS))
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[36:40] == b"data"
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert data[44:] == audio_to_pcm16(np.concatenate(CHUNKS))
    with wave.open(io.BytesIO(data)) as f:  # readers that stream WAV take it
        assert (f.getframerate(), f.getsampwidth(), f.getnchannels()) == (24000, 2, 1)
        assert f.readframes(10**9) == data[44:]


def test_a_single_chunk_is_an_exact_wav_and_pcm_is_raw():
    assert AudioStreamEncoder("wav").encode(CHUNKS[0], 24000, last=True) == encode_wav(CHUNKS[0], 24000)
    encoder = AudioStreamEncoder("pcm16")
    assert b"".join(encoder.encode(c, 24000, last=False) for c in CHUNKS) == audio_to_pcm16(np.concatenate(CHUNKS))


def test_chat_audio_deltas():
    deltas = AudioDeltas("pcm16", ttl_s=60)
    texts = ["Hel", "Hello wor", "Hello world!"]
    out = [deltas.delta(OmniRequestOutput(request_id="r", finished=i == 2, multimodal_output={"sample_rate": 24000}),
                        CHUNKS[i], texts[i]) for i in range(3)]
    assert len({d["id"] for d in out}) == 1
    assert "".join(d["transcript"] for d in out) == texts[-1]
    assert [("expires_at" in d) for d in out] == [False, False, True]
    assert b"".join(base64.b64decode(d["data"]) for d in out) == audio_to_pcm16(np.concatenate(CHUNKS))
