"""Live `vllm serve tiny/qwen3-tts --omni` (the talker on a vLLM EngineCore, the speech decoder in the server
process) through the official openai client: `/v1/audio/speech` streams the audio in >= 2 pieces while the talker
still reads the text (chunked bytes and SSE deltas), and the pieces add up to the non-streamed reply (same seed;
FLAC is encoded from the whole waveform at the end); concurrent requests share the talker's batch and get what
they get alone; named, OpenAI and unknown voices, and bad `instructions` / voices answer 400 naming the field.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.live_server import LiveServer
from vllm_omni.models.qwen3_omni.pipeline import CODE2WAV_CHUNK_SCHEDULE

pytestmark = pytest.mark.slow
MODEL = "tiny/qwen3-tts"
TEXT = "Once upon a time there was a small robot that loved to paint mountains and oceans."
FIRST_CHUNK_TOKENS = CODE2WAV_CHUNK_SCHEDULE[0] + 2
"""Talker tokens before the first decoder chunk is handed on (the pipeline's `first_chunk_tokens`)."""


@pytest.fixture(scope="module")
def server(stop_later):
    # The talker samples by default and random weights rarely stop: the model length bounds each reply
    # (prompt ~12 positions, then ~36 frames: 2.9 s of audio, decoder chunks of 4, 8, 16 and 8 frames).
    srv = LiveServer(MODEL, "--gpu-memory-utilization", "0.15", "--max-model-len", "48", "--enforce-eager",
                     "--dtype", "float32")
    yield srv
    stop_later(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


def speech(client, **kwargs) -> bytes:
    return client.audio.speech.create(model=MODEL, input=TEXT, response_format="pcm", **kwargs).content


def test_streamed_speech_equals_the_whole_reply(server, client, tiny_path):
    import av
    import httpx
    from transformers import AutoTokenizer

    # The talker reads one text token per frame: the first chunk is handed on while text is still unread.
    text_tokens = len(AutoTokenizer.from_pretrained(tiny_path)(TEXT)["input_ids"])
    assert text_tokens > FIRST_CHUNK_TOKENS + 1
    request = {"model": MODEL, "voice": "vivian", "input": TEXT, "extra_body": {"seed": 7}}
    with client.audio.speech.with_streaming_response.create(response_format="pcm", **request) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    pcm = b"".join(chunks)
    assert len(chunks) >= 2 and len(pcm) % (2 * 1920) == 0 and np.frombuffer(pcm, "<i2").std() > 30
    assert speech(client, voice="vivian", extra_body={"seed": 7}) == pcm

    flac = client.audio.speech.create(response_format="flac", **request).content
    with av.open(io.BytesIO(flac)) as container:
        whole = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    np.testing.assert_array_equal(whole.astype("<i2"), np.frombuffer(pcm, dtype="<i2"))

    body = {"model": MODEL, "voice": "vivian", "input": TEXT, "response_format": "pcm", "seed": 7,
            "stream_format": "sse"}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) >= 2
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm


def test_concurrent_requests_equal_solo(client):
    """Four requests at once (one talker batch): each gets the audio it gets alone, and voices differ."""
    voices = ["vivian", "ryan", "dylan", "alloy"]
    solo = {voice: speech(client, voice=voice, extra_body={"seed": 3}) for voice in voices[:2]}
    with ThreadPoolExecutor(len(voices)) as pool:
        together = list(pool.map(lambda v: speech(client, voice=v, extra_body={"seed": 3}), voices))
    assert together[0] == solo["vivian"] and together[1] == solo["ryan"]
    assert together[3] == together[0]  # OpenAI's "alloy" is the first speaker
    assert together[0] != together[1]


@pytest.mark.parametrize(("kwargs", "field"), [({"voice": "nobody"}, "voice"),
                                               ({"voice": "vivian", "speed": 2.0}, "speed")])
def test_bad_speech_requests_name_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError, match=field):
        speech(client, **kwargs)
