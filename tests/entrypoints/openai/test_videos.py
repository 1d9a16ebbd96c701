"""`/v1/videos` and `/v1/realtime/video` HTTP contract, isolated from the engine with a video-making FakeOmni.

What it pins: the official `openai` client's videos flow (create -> poll -> download, list with
order/after/limit, delete), the sync route's MP4 body, server default sampling params applying unless the
request sets a field (JSON and multipart strings alike), 400 naming the field for bad input (quality, frame
interpolation, sound, size, unreadable input_reference), and that deleting a running job aborts it.
"""

from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.entrypoints.openai.fake_engine import FakeOmni
from vllm_omni.diffusion.video_utils import decode_mp4
from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser
from vllm_omni.entrypoints.openai.api_server import build_app
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.outputs import OmniRequestOutput


class FakeVideoOmni(FakeOmni):
    """Returns a moving gradient of the asked size / frame count per output."""

    @property
    def default_sampling_params_list(self):
        return [OmniDiffusionSamplingParams(num_inference_steps=4, guidance_scale=7.5, quality="high",
                                            num_frames=5, fps=8)]

    async def _stage(self, stage_type, stage_id, prompt, request_id, params, last):
        await asyncio.sleep(self.step_delay_s)
        t, h, w = params.num_frames or 5, params.height or 32, params.width or 48
        ramp = np.linspace(0, 200, h * w * 3, dtype=np.float32).reshape(h, w, 3)
        video = np.stack([(ramp + 5 * i) for i in range(t)]).astype(np.uint8)
        videos = np.stack([video] * params.num_outputs_per_prompt) if params.num_outputs_per_prompt > 1 else video
        yield OmniRequestOutput(request_id=request_id, finished=last, stage_id=stage_id, final_output_type="video",
                                multimodal_output={"video": videos, "fps": params.fps or 16},
                                stage_durations={"diffusion.denoise": 0.01})


@pytest.fixture(scope="module")
def parser():
    return make_omni_arg_parser(FlexibleArgumentParser())


def make_client(parser, engine) -> TestClient:
    args = parser.parse_args(["fake-video", "--max-upload-mb", "1"])
    args.model = args.model_tag
    return TestClient(build_app(args, engine), raise_server_exceptions=False)


@pytest.fixture()
def video(parser):
    engine = FakeVideoOmni(stage_types=["diffusion"], output_modalities={"video"}, input_modalities={"text", "image"})
    with make_client(parser, engine) as client:
        yield engine, client


def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def wait_done(client: TestClient, video_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/v1/videos/{video_id}").json()
        if body["status"] in ("completed", "failed"):
            return body
        time.sleep(0.05)
    raise TimeoutError(video_id)


def assert_400(resp, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == 400 and param in (err["param"] or "") + err["message"]


def test_openai_client_create_poll_download(video):
    engine, client = video
    api = oai(client)
    job = api.videos.create(prompt="a cat", size="64x32", extra_body={"num_frames": 9, "seed": 3})
    assert job.status == "queued" and job.size == "64x32" and job.seconds == "1"
    done = wait_done(client, job.id)
    assert done["status"] == "completed" and done["progress"] == 100 and done["quality"] == "default"
    data = api.videos.download_content(job.id).read()
    assert decode_mp4(data).shape == (9, 32, 64, 3)
    sp = engine.seen[-1][2][0]
    # Explicit fields win (multipart strings were coerced); omitted ones keep the server defaults.
    assert (sp.num_frames, sp.seed, sp.width, sp.height) == (9, 3, 64, 32)
    assert (sp.num_inference_steps, sp.guidance_scale, sp.quality) == (4, 7.5, "high")
    # Issue 24: the job asks for progress only, so no frame chunks reach (and get re-joined in) this process.
    assert sp.stream_partial_outputs and not sp.stream_video_chunks


def test_sync_returns_mp4_and_json_fields_override_defaults(video):
    engine, client = video
    resp = client.post("/v1/videos/sync", json={"prompt": "waves", "size": "48x32", "seconds": 1, "fps": 8,
                                                  "num_inference_steps": 30, "guidance_scale": 6.5,
                                                  "num_outputs_per_prompt": 2})
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4"
    assert decode_mp4(resp.content).shape == (9, 32, 48, 3)  # 1 s at 8 fps (+ the first frame)
    sp = engine.seen[-1][2][0]
    assert (sp.num_inference_steps, sp.guidance_scale, sp.num_frames, sp.fps) == (30, 6.5, 9, 8)
    assert not sp.stream_partial_outputs  # the sync route wants no partials at all
    form = client.post("/v1/videos/sync", data={"prompt": "x", "num_inference_steps": "30", "guidance_scale": "6.5",
                                                "seed": "42", "quality": "high"})
    assert form.status_code == 200, form.text
    sp = engine.seen[-1][2][0]
    assert (sp.num_inference_steps, sp.guidance_scale, sp.seed, sp.quality) == (30, 6.5, 42, "high")


def test_list_order_after_limit_and_delete(video):
    _, client = video
    ids = [client.post("/v1/videos", json={"prompt": f"p{i}"}).json()["id"] for i in range(3)]
    for vid in ids:
        wait_done(client, vid)
    desc = client.get("/v1/videos", params={"limit": 2}).json()
    assert [v["id"] for v in desc["data"]] == ids[::-1][:2] and desc["has_more"] is True
    asc = client.get("/v1/videos", params={"order": "asc", "after": ids[0]}).json()
    assert [v["id"] for v in asc["data"]] == ids[1:] and asc["has_more"] is False
    assert client.delete(f"/v1/videos/{ids[0]}").json() == {"id": ids[0], "object": "video.deleted",
                                                             "deleted": True}
    assert client.get(f"/v1/videos/{ids[0]}").status_code == 404
    assert_400(client.get("/v1/videos", params={"order": "sideways"}), "order")


class ChunkingVideoOmni(FakeVideoOmni):
    """A stage that streams frame chunks even to a progress-only request (what the Wan pipeline must not do)."""

    async def _stage(self, stage_type, stage_id, prompt, request_id, params, last):
        yield OmniRequestOutput(request_id=request_id, finished=False, stage_id=stage_id, final_output_type="video",
                                multimodal_output={"video_chunk": np.zeros((1, 32, 48, 3), np.uint8), "fps": 8,
                                                   "frame_start": 0})
        async for out in super()._stage(stage_type, stage_id, prompt, request_id, params, last):
            yield out


def test_a_job_refuses_frame_chunks_instead_of_joining_them(parser):
    """Issue 24: the job route holds no chunks; a stage that streams them anyway fails the job, naming why."""
    engine = ChunkingVideoOmni(stage_types=["diffusion"], output_modalities={"video"})
    with make_client(parser, engine) as client:
        done = wait_done(client, client.post("/v1/videos", json={"prompt": "x"}).json()["id"])
    assert done["status"] == "failed" and "video chunks" in done["error"]["message"], done


def test_deleting_a_running_job_aborts_it(parser):
    engine = FakeVideoOmni(stage_types=["diffusion"], output_modalities={"video"}, step_delay_s=5.0)
    with make_client(parser, engine) as client:
        vid = client.post("/v1/videos", json={"prompt": "slow"}).json()["id"]
        deadline = time.monotonic() + 5
        while not engine.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get(f"/v1/videos/{vid}/content").status_code == 409
        assert client.delete(f"/v1/videos/{vid}").status_code == 200
        assert vid in engine.aborted


def test_bad_input_is_400_naming_the_field(video):
    _, client = video
    assert_400(client.post("/v1/videos", json={"prompt": "x", "quality": "medium"}), "quality")
    assert_400(client.post("/v1/videos", json={"prompt": "x", "frame_interpolation_scale": 0}),
               "frame_interpolation_scale")
    assert_400(client.post("/v1/videos", json={"prompt": "x", "sound_duration": 0}), "sound_duration")
    assert_400(client.post("/v1/videos", json={"prompt": "x", "seconds": -1}), "seconds")
    assert_400(client.post("/v1/videos", json={"prompt": "x", "size": "big"}), "size")
    # an unknown field is ignored with a warning (vLLM's policy; --strict-request-fields: test_server_contract)
    assert client.post("/v1/videos", json={"prompt": "x", "colour": "red"}).status_code == 200
    assert_400(client.post("/v1/videos", json={"prompt": "x", "generate_sound": True}), "generate_sound")
    for name, value in (("sound_duration", 2.0), ("frame_interpolation_exp", 1), ("frame_interpolation_scale", 1.0)):
        resp = client.post("/v1/videos", json={"prompt": "x", name: value})  # valid values, never read: refused
        assert_400(resp, name)
        assert resp.json()["error"]["param"] == name
    assert_400(client.post("/v1/videos", data={"prompt": "x", "seed": "many"}), "seed")
    assert_400(client.post("/v1/videos", data={"prompt": "x"},
                           files={"input_reference": ("ref.png", io.BytesIO(b"not an image"), "image/png")}),
               "input_reference")
    assert_400(client.post("/v1/videos", json={"prompt": "x", "input_reference": "http://example.com/a.png"}),
               "input_reference")
    assert client.get("/v1/videos/video_missing").status_code == 404


def test_image_model_rejects_videos_api(parser):
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"})
    with make_client(parser, engine) as client:
        assert_400(client.post("/v1/videos", json={"prompt": "x"}), "model")


def test_video_model_rejects_images_api(video):
    engine, client = video
    resp = client.post("/v1/images/generations", json={"prompt": "x"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "model" and "outputs image" in err["message"] and engine.seen == []


def test_websocket_streams_fragmented_mp4(video):
    _, client = video
    with client.websocket_connect("/v1/realtime/video") as ws:
        ws.send_json({"type": "session.ping"})
        assert ws.receive_json()["type"] == "session.pong"
        ws.send_json({"type": "session.start", "prompt": "a cat",
                      "sampling_params": {"num_frames": 9, "size": "48x32"}, "frames_per_chunk": 4})
        start = ws.receive_json()
        assert start["type"] == "video.start" and (start["num_frames"], start["width"]) == (9, 48)
        chunks = []
        while True:
            msg = ws.receive_json()
            if msg["type"] == "session.done":
                break
            assert msg["type"] == "video.chunk_metadata"
            chunks.append(ws.receive_bytes())
            assert len(chunks[-1]) == msg["num_bytes"]
        assert len(chunks) == 3
        assert decode_mp4(b"".join(chunks)).shape == (9, 32, 48, 3)
        ws.send_json({"type": "session.start", "prompt": "x", "sampling_params": {"quality": "medium"}})
        err = ws.receive_json()
        assert err["type"] == "error" and err["param"] == "quality"


def test_input_reference_reaches_the_engine_as_an_image(video):
    from PIL import Image

    engine, client = video
    buf = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 10, 10)).save(buf, format="PNG")
    job = oai(client).videos.create(prompt="animate it", input_reference=("ref.png", buf.getvalue(), "image/png"),
                                    extra_body={"num_frames": 5})
    assert wait_done(client, job.id)["status"] == "completed"
    image = engine.seen[-1][0]["multi_modal_data"]["image"]
    assert image.size == (40, 24) and image.getpixel((0, 0)) == (200, 10, 10)
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    resp = client.post("/v1/videos/sync", json={"prompt": "x", "input_reference": {"image_url": url}})
    assert resp.status_code == 200 and engine.seen[-1][0]["multi_modal_data"]["image"].size == (40, 24)


async def test_cancelled_session_closes_the_encoder_only_after_its_running_call():
    """A WebSocket session cancelled (client gone) while a chunk was being encoded in a thread closed the
    encoder from the event loop meanwhile; the writer is not thread-safe (a server segfaulted in the sweep)."""
    import threading

    from vllm_omni.entrypoints.openai.serving_video_stream import _FragmentSender

    class Writer:
        fps, frames_flushed = 8, 0

        def __init__(self):
            self.busy, self.overlaps, self.closed = threading.Lock(), 0, False

        def write(self, frames):
            with self.busy:
                threading.Event().wait(0.3)
            return b""

        def close(self):
            if not self.busy.acquire(blocking=False):
                self.overlaps += 1
            else:
                self.busy.release()
            self.closed = True
            return b""

    sender = _FragmentSender(ws=None, num_frames=4, started=0.0)
    sender.writer = writer = Writer()
    task = asyncio.create_task(sender.add(np.zeros((1, 8, 8, 3), np.uint8), 8))
    await asyncio.sleep(0.1)  # the write runs in its thread
    task.cancel()
    await sender.close()
    assert writer.closed and writer.overlaps == 0
