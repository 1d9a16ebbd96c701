"""Live `vllm serve tiny/ltx2 --omni`: a clip with its soundtrack through the Videos API and the video WebSocket.

Pins (issue 28): the official `openai` client's create -> poll -> download returns a playable MP4 (H.264 + FLAC)
whose audio stream PyAV decodes to the waveform offline `Omni` returns for the same request (16-bit PCM: SNR
>= 60 dB) and whose frames are the offline frames; the WebSocket route streams fragments that each carry their
frames' share of the soundtrack and concatenate to the same clip with sound; `two_stage` (the base pass, the
latent upsampler, the refine pass) on the same server gives the offline two-stage clip; with `--enable-lora` the
refine pass runs the checkpoint's distilled LoRA, and `refine_lora` naming a registered adapter resolves to its
file; a bad value of it or of its `refine_lora`, or a size the pipeline (or two-stage's base pass) cannot make, is
a 400 naming the field on the sync and async routes.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import openai
import pytest
from websockets.sync.client import connect

from vllm_omni.diffusion.video_utils import decode_mp4, decode_mp4_audio, encode_mp4

MODEL = "tiny/ltx2"
FAST = {"num_frames": 9, "num_inference_steps": 2, "seed": 3, "fps": 24, "guidance_scale": 3.0}
PROMPT = "A dog barks and runs through a field."
TWO_STAGE = {**FAST, "two_stage": True}
"""At 128x64: the base pass at 64x32."""


def snr(signal: np.ndarray, reference: np.ndarray) -> float:
    noise = np.sum((signal.astype(np.float64) - reference.astype(np.float64)) ** 2)
    return float("inf") if noise == 0 else 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / noise)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(MODEL)


@pytest.fixture(scope="module")
def offline_runs():
    """What offline `Omni` returns for the requests the server gets (same seed and knobs): one stage at 64x32,
    two stages at 128x64."""
    from vllm_omni import Omni, OmniDiffusionSamplingParams

    omni = Omni(model=MODEL)
    try:
        (one,) = omni.generate([PROMPT], OmniDiffusionSamplingParams(height=32, width=64, **FAST))
        (two,) = omni.generate([PROMPT], OmniDiffusionSamplingParams(height=64, width=128, **TWO_STAGE))
    finally:
        omni.close()
    return one.multimodal_output, two.multimodal_output


@pytest.fixture(scope="module")
def offline(offline_runs):
    return offline_runs[0]


def job_mp4(server, size: str, extra: dict) -> bytes:
    """The official client's create -> poll -> download of one job."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    job = client.videos.create(model=MODEL, prompt=PROMPT, size=size, extra_body=extra)
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = client.videos.retrieve(job.id)
    assert job.status == "completed", job.error
    return client.videos.download_content(job.id).read()


def test_openai_client_mp4_carries_the_offline_soundtrack(server, offline):
    assert offline["video"].shape == (9, 32, 64, 3) and offline["audio"].shape[0] == 2
    mp4 = job_mp4(server, "64x32", FAST)
    frames = decode_mp4(mp4)
    assert frames.shape == offline["video"].shape
    # The tiny model's frames are near noise, which H.264 keeps only roughly: compare with the offline clip
    # through the same encoder (x264 is deterministic).
    assert np.array_equal(frames, decode_mp4(encode_mp4(offline["video"], FAST["fps"])))
    audio, rate = decode_mp4_audio(mp4)
    assert rate == offline["sample_rate"] == 16000
    assert audio.shape == offline["audio"].shape and np.abs(offline["audio"]).max() > 1e-3
    assert snr(audio, offline["audio"]) >= 60.0


def test_websocket_fragments_carry_the_soundtrack(server, offline):
    with connect(server.url.replace("http", "ws") + "/v1/realtime/video", open_timeout=30) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "session.start",
                    "prompt": PROMPT,
                    "frames_per_chunk": 4,
                    "sampling_params": {**FAST, "size": "64x32"},
                }
            )
        )
        start = json.loads(ws.recv(timeout=120))
        assert start["type"] == "video.start", start
        assert (start["audio_codec"], start["sample_rate"], start["channels"]) == ("flac", 16000, 2)
        chunks = []
        while (msg := json.loads(ws.recv(timeout=120)))["type"] != "session.done":
            assert msg["type"] == "video.chunk_metadata", msg
            chunks.append(ws.recv(timeout=60))
    assert len(chunks) >= 2
    clip = b"".join(chunks)
    assert decode_mp4(clip).shape == offline["video"].shape
    audio, _ = decode_mp4_audio(clip)
    assert snr(audio, offline["audio"]) >= 60.0


def test_two_stage_job_carries_the_offline_two_stage_clip(server, offline_runs):
    two = offline_runs[1]
    assert two["video"].shape == (9, 64, 128, 3)
    mp4 = job_mp4(server, "128x64", TWO_STAGE)
    assert np.array_equal(decode_mp4(mp4), decode_mp4(encode_mp4(two["video"], FAST["fps"])))
    audio, _ = decode_mp4_audio(mp4)
    assert audio.shape == two["audio"].shape and snr(audio, two["audio"]) >= 60.0


def test_two_stage_with_lora_on_refines_with_the_distilled_lora(server, shared_server, offline_runs):
    """`--enable-lora`: the default refine adapter (the checkpoint's file) and `refine_lora` naming the same file
    registered under a name give one clip, which is not the clip refined without it."""
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.models.ltx2.pipeline import DISTILLED_LORA

    distilled = build_tiny("ltx2") / DISTILLED_LORA
    lora_server = shared_server(MODEL, "--enable-lora", "--lora-modules", f"distilled={distilled}")
    default = job_mp4(lora_server, "128x64", TWO_STAGE)
    named = job_mp4(lora_server, "128x64", {**TWO_STAGE, "refine_lora": {"name": "distilled"}})
    assert decode_mp4_audio(named)[0].shape == decode_mp4_audio(default)[0].shape
    assert snr(decode_mp4_audio(named)[0], decode_mp4_audio(default)[0]) >= 60.0
    assert np.array_equal(decode_mp4(named), decode_mp4(default))
    without = decode_mp4(encode_mp4(offline_runs[1]["video"], FAST["fps"])).astype(np.float64)
    mse = np.mean((decode_mp4(default).astype(np.float64) - without) ** 2)
    assert 10 * np.log10(255.0**2 / mse) < 30.0, "the refine pass ran the adapter"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"two_stage": "maybe"}, "two_stage"),
        ({"two_stage": True, "size": "96x64"}, "size"),  # 96 = 3 x 32: the base pass would be 48 wide
        ({"size": "80x64"}, "size"),
        ({"two_stage": True, "refine_lora": "distilled"}, "refine_lora"),  # not an adapter object
        ({"two_stage": True, "refine_lora": {"name": "distilled"}}, "refine_lora"),  # served without --enable-lora
    ],
    ids=["not_a_bool", "odd_base_size", "odd_size", "refine_lora_not_an_object", "refine_lora_without_lora"],
)
@pytest.mark.parametrize("route", ["/v1/videos/sync", "/v1/videos"])
def test_bad_size_or_two_stage_is_a_400_naming_the_field(server, route, body, param):
    """On the async route too: refused before a job exists (LTX-2's shape rule in the API process), not a job
    that is created and then fails."""
    resp = httpx.post(f"{server.url}{route}", json={"prompt": "x", **FAST, **body}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    if body.get("size") == "96x64":
        assert "two_stage" in resp.json()["error"]["message"], resp.text
