"""Live `vllm serve tiny/qwen3-omni --omni` (thinker and talker on two vLLM EngineCores, code2wav in the server
process) through the official openai client. Pins: chat with modalities ["text", "audio"] returns the thinker's
text and a base64 WAV equal to transformers' greedy `generate(return_audio=True)` (same text, same samples up to
16-bit quantization), streamed text equals the plain answer and the audio arrives at the end of
the stream, a text-only chat never runs the talker or the vocoder, and `audio.speech.create` returns a WAV.
"""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.live_server import LiveServer

from .conftest import chat_prompt_ids, hf_generate

pytestmark = pytest.mark.slow
MODEL = "tiny/qwen3-omni"
USER_TEXT = "Hello! How are you today?"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": USER_TEXT}]
THINKER_TOKENS = 8
TALKER_TOKENS = 10
PARAMS_LIST = [{"temperature": 0.0, "max_tokens": THINKER_TOKENS, "ignore_eos": True},
               {"max_tokens": TALKER_TOKENS, "temperature": 0.0}, {}]


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(MODEL, "--gpu-memory-utilization", "0.15", "--max-model-len", "256", "--enforce-eager",
                     "--dtype", "float32")
    yield srv
    assert srv.close(), f"server did not shut down cleanly on SIGTERM; log: {srv.log}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(hf_model, tiny_path):
    from transformers import AutoTokenizer

    ids = chat_prompt_ids(tiny_path, USER_TEXT)
    tokens, frames, wav = hf_generate(hf_model, ids, THINKER_TOKENS, TALKER_TOKENS)
    # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence (random weights emit those).
    text = AutoTokenizer.from_pretrained(tiny_path).decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    return text, wav


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as f:
        assert f.getnchannels() == 1 and f.getsampwidth() == 2
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
        return pcm.astype(np.float32) / 32767.0, f.getframerate()


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_text_and_audio_equal_transformers(client, reference):
    ref_text, ref_wav = reference
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        extra_body={"sampling_params_list": PARAMS_LIST})
    message = out.choices[0].message
    assert message.content == ref_text and message.audio.transcript == ref_text
    audio, rate = read_wav(base64.b64decode(message.audio.data))
    assert rate == 24000 and len(audio) == len(ref_wav)
    np.testing.assert_allclose(audio, np.clip(ref_wav, -1, 1), atol=2e-4)
    assert audio.std() > 1e-3


def test_text_only_chat_skips_talker_and_vocoder(server, client, reference):
    """modalities=["text"]: the thinker's answer alone; the talker and the vocoder never see the request."""
    count = "vllm_omni:stage_duration_seconds_count"
    before = {s: server.metric(count, stage=s) for s in ("stage-0-llm", "stage-1-llm", "stage-2-generation")}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"],
                                         extra_body={"sampling_params_list": PARAMS_LIST})
    assert out.choices[0].message.content == reference[0] and out.choices[0].message.audio is None
    after = {s: server.metric(count, stage=s) for s in before}
    assert after["stage-0-llm"] == before["stage-0-llm"] + 1
    assert after["stage-1-llm"] == before["stage-1-llm"] and after["stage-2-generation"] == before["stage-2-generation"]


def test_stream_text_then_audio(client, reference):
    ref_text, ref_wav = reference
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], stream=True,
        extra_body={"sampling_params_list": PARAMS_LIST})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == ref_text  # (vLLM may coalesce the 8 tokens' deltas into one chunk when the reader lags)
    audio_deltas = [c.choices[0].delta.audio for c in chunks if c.choices[0].delta.audio is not None]
    assert len(audio_deltas) == 1 and audio_deltas[0].transcript == ref_text
    audio, _ = read_wav(base64.b64decode(audio_deltas[0].data))
    np.testing.assert_allclose(audio, np.clip(ref_wav, -1, 1), atol=2e-4)


def test_speech(client):
    response = client.audio.speech.create(model=MODEL, voice="ethan", input=USER_TEXT, response_format="wav")
    audio, rate = read_wav(response.content)
    assert rate == 24000 and len(audio) > 0 and audio.std() > 1e-3


def test_speech_with_openai_voice_and_mp3(client):
    """OpenAI's defaults: voice "alloy" (not a Qwen3-Omni speaker) speaks in the model's default voice, and
    response_format "mp3" is encoded with PyAV."""
    import av

    response = client.audio.speech.create(model=MODEL, voice="alloy", input=USER_TEXT, response_format="mp3")
    with av.open(io.BytesIO(response.content)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
    assert stream.codec_context.name.startswith("mp3") and stream.rate == 24000 and samples > 0


def test_unknown_voice_is_a_client_error(client):
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.audio.speech.create(model=MODEL, voice="nobody", input=USER_TEXT)


def test_sleep_and_wake_the_whole_pipeline(server, client):
    """Sleep and wake reach the thinker and the talker; Code2Wav (a GENERATION stage in the server process) has
    nothing to release and is skipped instead of failing the call; chat works again after waking."""
    import httpx

    for route in ("/v1/omni/sleep", "/v1/omni/wakeup"):
        resp = httpx.post(f"{server.url}{route}", json={}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert [a["stage_id"] for a in resp.json()["acks"]] == [0, 1]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, modalities=["text"])
    assert out.choices[0].message.content is not None
