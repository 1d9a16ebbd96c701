"""Live `vllm serve tiny/qwen3-omni --omni` (thinker and talker on two vLLM EngineCores, code2wav in the server
process) through the official openai client. Pins: chat with modalities ["text", "audio"] returns the thinker's
text and a base64 WAV equal to transformers' greedy `generate(return_audio=True)` (same text, same samples up to
16-bit quantization), streamed text equals the plain answer and the audio arrives at the end of
the stream, a text-only chat never runs the talker or the vocoder, and `audio.speech.create` returns a WAV.
Media content parts (`input_audio` WAV + `image_url`) reach vLLM's thinker: the text equals transformers' on the
same decoded inputs; bad or oversized media is a 400 naming the field, with a request in flight untouched.
Streamed audio (both stage edges stream): a long answer's audio
chunks share one id, their transcripts add up to the text and their PCM to the non-streamed reply's (and to
transformers' vocoder on the pipeline's chunks of the same frames); `/v1/audio/speech` streams raw bytes
(`with_streaming_response`) and SSE events.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.live_server import LiveServer

from .conftest import chat_prompt_ids, hf_generate, hf_thinker_tokens, media_inputs, media_prompt
from .vocoder_reference import hf_vocoder_chunks

pytestmark = pytest.mark.slow
MODEL = "tiny/qwen3-omni"
USER_TEXT = "Hello! How are you today?"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": USER_TEXT}]
THINKER_TOKENS = 8
TALKER_TOKENS = 10
PARAMS_LIST = [{"temperature": 0.0, "max_tokens": THINKER_TOKENS, "ignore_eos": True},
               {"max_tokens": TALKER_TOKENS, "temperature": 0.0}, {}]


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL, "--gpu-memory-utilization", "0.15", "--max-model-len", "1024", "--enforce-eager",
                     "--dtype", "float32", "--max-input-audio-seconds", "5", "--max-input-video-frames", "2",
                     "--skip-mm-profiling")  # the thinker's dummy multimodal profile: ~20 s of CPU, sizes nothing
    yield srv
    stop_later(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(hf_model, tiny_path):
    from transformers import AutoTokenizer

    ids = chat_prompt_ids(tiny_path, USER_TEXT)
    tokens, frames, _ = hf_generate(hf_model, ids, THINKER_TOKENS, TALKER_TOKENS)
    wav = hf_vocoder_chunks(hf_model, frames)  # transformers' vocoder on the pipeline's chunk schedule
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
    before = {s: server.metric(count, stage_id=s) for s in ("0", "1", "2")}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"],
                                         extra_body={"sampling_params_list": PARAMS_LIST})
    assert out.choices[0].message.content == reference[0] and out.choices[0].message.audio is None
    after = {s: server.metric(count, stage_id=s) for s in before}
    assert after["0"] == before["0"] + 1
    assert after["1"] == before["1"] and after["2"] == before["2"]


def test_stream_text_then_audio(client, reference):
    ref_text, ref_wav = reference
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, modalities=["text", "audio"], stream=True,
        extra_body={"sampling_params_list": PARAMS_LIST})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == ref_text  # (vLLM may coalesce the 8 tokens' deltas into one chunk when the reader lags)
    audio_deltas = [c.choices[0].delta.audio for c in chunks if c.choices[0].delta.audio is not None]
    # one delta per vocoder chunk (the first one 4 frames), one id; transcripts add up to the answer
    assert len({d.id for d in audio_deltas}) == 1 and "".join(d.transcript or "" for d in audio_deltas) == ref_text
    data = b"".join(base64.b64decode(d.data) for d in audio_deltas if d.data)  # one WAV stream
    assert data[:4] == b"RIFF" and data[36:40] == b"data"
    audio = np.frombuffer(data[44:], dtype="<i2").astype(np.float32) / 32767.0
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
    nothing to release and is skipped instead of failing the call; after waking, chat answers exactly what it
    answered before sleeping (greedy), so the woken weights are the same weights."""
    import httpx

    def answer() -> str:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=THINKER_TOKENS,
                                             temperature=0, modalities=["text"], extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == THINKER_TOKENS
        return out.choices[0].message.content

    before = answer()
    for route in ("/v1/omni/sleep", "/v1/omni/wakeup"):
        resp = httpx.post(f"{server.url}{route}", json={}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert [a["stage_id"] for a in resp.json()["acks"]] == [0, 1]
    assert answer() == before


@pytest.mark.parametrize("spoken", [False, True], ids=["streamed_text", "spoken_reply"])
def test_playground_chat_form_in_chromium(server, client, spoken):
    """The playground's chat form (tests/entrypoints/openai/test_playground_browser.py has the others) shows what
    the openai client gets for the same request: the streamed text, and a spoken reply as a WAV the browser's
    audio element decodes to the same duration."""
    import json

    from selenium.webdriver.common.by import By

    from tests.entrypoints.openai.browser import chromium, fill, screenshot, wait_for

    extra = {"temperature": 0.0, "ignore_eos": True, "sampling_params_list": PARAMS_LIST}
    modalities = ["text", "audio"] if spoken else ["text"]
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": USER_TEXT}], max_tokens=THINKER_TOKENS,
        modalities=modalities, audio={"format": "wav", "voice": "ethan"} if spoken else None,
        extra_body={k: v for k, v in extra.items() if k != "temperature"}, temperature=0.0).choices[0].message
    with chromium() as driver:
        driver.get(server.url + "/playground")
        fill(driver, "chat-input", USER_TEXT)
        fill(driver, "chat-max-tokens", str(THINKER_TOKENS))
        driver.find_element(By.CSS_SELECTOR, "#chat details summary").click()
        fill(driver, "chat-extra", json.dumps(extra))
        if spoken:
            driver.find_element(By.ID, "chat-audio").click()
        driver.find_element(By.ID, "chat-send").click()
        wait_for(driver, "document.getElementById('chat-output').dataset.done === '1'"
                         " || document.getElementById('chat-output').classList.contains('error')", 300)
        shown = driver.execute_script("return document.getElementById('chat-output').textContent;")
        assert shown == expected.content
        if spoken:
            duration = wait_for(driver, "(() => { const a = document.getElementById('chat-audio-player');"
                                        " return a.readyState >= 1 ? a.duration : null; })()", 30)
            samples, rate = read_wav(base64.b64decode(expected.audio.data))
            assert abs(duration - len(samples) / rate) < 0.01
        screenshot(driver, f"playground_chat_{'spoken' if spoken else 'text'}")


def wav_part(audio: np.ndarray) -> dict:
    from vllm_omni.entrypoints.openai.media import encode_wav

    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(encode_wav(audio, 16000)).decode(),
                                                   "format": "wav"}}


def image_part(image) -> dict:
    from vllm_omni.entrypoints.openai.media import image_data_url

    return {"type": "image_url", "image_url": {"url": image_data_url(image)}}


def media_messages(*parts: dict, text: str = "What is this?") -> list[dict]:
    return [MESSAGES[0], {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_chat_with_audio_and_image_equals_transformers(client, hf_model, tiny_path):
    """input_audio (WAV) + image_url through vLLM's parser and media connector to vLLM's thinker: the text equals
    transformers' greedy thinker on the WAV's 16-bit samples and the same image."""
    from transformers import AutoTokenizer

    audio, image, _ = media_inputs()
    out = client.chat.completions.create(model=MODEL, messages=media_messages(wav_part(audio), image_part(image)),
                                         modalities=["text"], extra_body={"sampling_params_list": PARAMS_LIST})
    decoded = (np.clip(audio, -1, 1) * 32767).astype("<i2").astype(np.float32) / 32768  # what the WAV holds
    prompt = media_prompt(tiny_path, ["audio", "image"], "What is this?")
    tokens = hf_thinker_tokens(hf_model, tiny_path, prompt, THINKER_TOKENS, audio=[decoded], images=[image])
    text = AutoTokenizer.from_pretrained(tiny_path).decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    assert out.choices[0].message.content == text and out.choices[0].message.audio is None


def test_spoken_answer_to_audio_and_image_equals_transformers(client, hf_model, tiny_path, monkeypatch):
    """input_audio + image_url with modalities ["text", "audio"]: the talker takes the thinker's hidden states at
    the media positions; text equals transformers' `generate(return_audio=True)`, the waveform its vocoder on the
    pipeline's chunk schedule of transformers' codec frames (16-bit WAV)."""
    from transformers import AutoTokenizer

    from vllm_omni.models.qwen3_omni.processing import qwen3_omni_processor

    audio, image, _ = media_inputs()
    out = client.chat.completions.create(model=MODEL, messages=media_messages(wav_part(audio), image_part(image)),
                                         modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
                                         extra_body={"sampling_params_list": PARAMS_LIST})
    decoded = (np.clip(audio, -1, 1) * 32767).astype("<i2").astype(np.float32) / 32768  # what the WAV holds
    prompt = media_prompt(tiny_path, ["audio", "image"], "What is this?")
    inputs = qwen3_omni_processor(str(tiny_path))(text=prompt, audio=[decoded], images=[image], return_tensors="pt")
    # transformers' talker M-RoPE reads `audio_config.n_window` from its own config, which has none.
    monkeypatch.setattr(hf_model.talker.config, "audio_config", hf_model.config.thinker_config.audio_config,
                        raising=False)
    seen, chunked_decode = {}, hf_model.code2wav.chunked_decode

    def record_codes(codes, **kwargs):  # transformers' codec frames, for its vocoder on the pipeline's chunks
        seen["frames"] = codes[0].T.tolist()
        return chunked_decode(codes, **kwargs)

    monkeypatch.setattr(hf_model.code2wav, "chunked_decode", record_codes)
    sequences, _ = hf_model.generate(
        **inputs, thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=None,
        talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, talker_repetition_penalty=1.0, return_audio=True)
    ref_wav = hf_vocoder_chunks(hf_model, seen["frames"])
    tokens = sequences[0, inputs["input_ids"].shape[1]:].tolist()
    text = AutoTokenizer.from_pretrained(tiny_path).decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    message = out.choices[0].message
    assert message.content == text and message.audio.transcript == text
    wav, rate = read_wav(base64.b64decode(message.audio.data))
    assert rate == 24000
    np.testing.assert_allclose(wav, np.clip(ref_wav, -1, 1), atol=2e-4)


def _bad_media_cases() -> list[tuple[str, list[dict], dict, str]]:
    audio, image, _ = media_inputs()
    flac = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}
    not_wav = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not a wav").decode(), "format": "wav"}}
    not_png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    garbage = base64.b64encode(b"x" * 64).decode()
    not_mp4 = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{garbage}"}}
    long_audio = wav_part(np.zeros(16000 * 6, dtype=np.float32))
    return [
        ("format", media_messages(flac), {}, "messages[1].content[0].input_audio.format"),
        ("undecodable-audio", media_messages(not_wav), {}, "messages"),
        ("undecodable-image", media_messages(not_png), {}, "messages[1].content[0].image_url"),
        ("undecodable-video", media_messages(not_mp4), {}, "messages"),
        ("audio-too-long", media_messages(long_audio), {}, "messages"),
        ("local-file", media_messages({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}), {},
         "messages"),  # no --allowed-local-media-path: vLLM refuses local files
        ("unknown-part", media_messages({"type": "file", "file": {}}), {}, "messages[1].content[0]"),
    ]


def _open_fds(pid: int) -> set[str]:
    import contextlib
    import os

    fds = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            fds.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {target for target in fds if target.startswith(("/tmp", "/dev/shm"))}


def test_bad_media_is_400_naming_the_field_and_spares_requests_in_flight(server, client, reference):
    """Each bad media request answers 400 with `param`, while a streamed text request in flight finishes with its
    normal answer; the server holds no more temp / shm files afterwards than before."""
    import threading

    import httpx

    before = _open_fds(server.proc.pid)
    streamed: list[str] = []

    def stream_in_flight() -> None:
        params = [{**PARAMS_LIST[0], "max_tokens": 64}, *PARAMS_LIST[1:]]
        chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], stream=True,
                                                extra_body={"sampling_params_list": params})
        streamed.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    thread = threading.Thread(target=stream_in_flight)
    thread.start()
    for name, messages, extra, param in _bad_media_cases():
        resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": messages, **extra})
        assert resp.status_code == 400, (name, resp.text)
        assert resp.json()["error"]["param"] == param, (name, resp.text)
    thread.join(timeout=300)
    assert streamed and streamed[0].startswith(reference[0])
    assert _open_fds(server.proc.pid) <= before


LONG_THINKER, LONG_TALKER = 900, 40
"""The first vocoder chunk needs 26 talker frames, i.e. 27 thinker tokens; the thinker writes 900 (some 4x what
it writes, on this tiny model, while the talker and vocoder make that chunk), so audio comes mid-answer on a
loaded machine too."""
REFERENCE_THINKER = 60
"""The 40 talker frames read the first ~45 thinker tokens: transformers' frames from 60 tokens equal those from 900
(checked), and so does the non-streamed answer's audio, which this test compares at 60 tokens (the streamed
answer already makes all 900)."""
LONG_PARAMS = [{"temperature": 0.0, "max_tokens": LONG_THINKER, "ignore_eos": True},
               {"max_tokens": LONG_TALKER, "temperature": 0.0}, {}]


def test_streamed_audio_chunks_come_while_the_answer_is_written(client, hf_model, tiny_path):
    kwargs = {"model": MODEL, "messages": MESSAGES, "modalities": ["text", "audio"],
              "audio": {"voice": "ethan", "format": "pcm16"}, "extra_body": {"sampling_params_list": LONG_PARAMS}}
    events, usage = [], None
    for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = c.usage or usage
        delta = c.choices[0].delta if c.choices else None
        if delta is not None and delta.content:
            events.append(("text", delta.content))
        if delta is not None and delta.audio is not None:
            events.append(("audio", delta.audio if isinstance(delta.audio, dict) else delta.audio.model_dump()))
    audio = [value for kind, value in events if kind == "audio"]
    text = "".join(value for kind, value in events if kind == "text")
    # The talker stops at its 40 frames while the thinker writes on: the rest of the answer and of the transcript
    # comes after the audio, and the stream ends with the thinker's last token, not the audio's end.
    assert usage.completion_tokens == LONG_THINKER
    assert "".join(a["transcript"] or "" for a in audio) == text and len({a["id"] for a in audio}) == 1
    data = [a for a in audio if a.get("data")]
    assert len(data) >= 2, "the talker's 40 frames are two vocoder chunks (25 + 15): audio must stream"
    assert data[-1]["expires_at"] is not None and all(a.get("expires_at") is None for a in data[:-1])
    # The order of one SSE stream is the server's (the client's load cannot change it): the audio is spoken
    # while the answer is written, not handed over after its last token.
    kinds = [kind if kind == "text" or value.get("data") else "transcript" for kind, value in events]
    last_text, first_audio = len(kinds) - 1 - kinds[::-1].index("text"), kinds.index("audio")
    assert first_audio < last_text, "the first audio chunk came after the last text delta"
    streamed = b"".join(base64.b64decode(a["data"]) for a in data)

    short = [{**LONG_PARAMS[0], "max_tokens": REFERENCE_THINKER}, *LONG_PARAMS[1:]]  # the same 40 frames
    whole = client.chat.completions.create(**{**kwargs, "extra_body": {"sampling_params_list": short}})
    whole = whole.choices[0].message
    assert base64.b64decode(whole.audio.data) == streamed
    _, frames, _ = hf_generate(hf_model, chat_prompt_ids(tiny_path, USER_TEXT), REFERENCE_THINKER, LONG_TALKER)
    ref = hf_vocoder_chunks(hf_model, frames)  # transformers' vocoder on the pipeline's chunk schedule
    pcm = np.frombuffer(streamed, dtype="<i2").astype(np.float32) / 32767.0
    np.testing.assert_allclose(pcm, np.clip(ref, -1, 1), atol=2e-4)


def test_speech_streams_bytes_and_sse_events(server, client):
    """`/v1/audio/speech` sends the audio in >= 2 pieces as it is made (chunked bytes and SSE deltas), and with a
    `seed` (every sampling stage's: the thinker and the talker sample by default) the streamed audio is the
    non-streamed one: FLAC, lossless, is encoded from the whole waveform at the end. Another seed gives other
    audio (the seed reaches the sampling)."""
    import av
    import httpx

    speech = {"model": MODEL, "voice": "ethan", "input": USER_TEXT, "extra_body": {"seed": 7}}
    with client.audio.speech.with_streaming_response.create(response_format="pcm", **speech) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    pcm = b"".join(chunks)
    assert len(chunks) >= 2 and len(pcm) > 0 and len(pcm) % 2 == 0  # sent as it is made, not in one piece
    body = {"model": MODEL, "voice": "ethan", "input": USER_TEXT, "response_format": "pcm", "seed": 7}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=300,
                      json={**body, "stream_format": "sse"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] > 0
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm

    flac = client.audio.speech.create(response_format="flac", **speech).content
    with av.open(io.BytesIO(flac)) as container:
        whole = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    np.testing.assert_array_equal(whole.astype("<i2"), np.frombuffer(pcm, dtype="<i2"))
    other = client.audio.speech.create(response_format="pcm", **{**speech, "extra_body": {"seed": 8}}).content
    assert other != pcm
