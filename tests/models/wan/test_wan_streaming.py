"""Wan partial outputs through AsyncOmni (engine, worker process, control plane) on the tiny checkpoint.

Pins: with `stream_partial_outputs`, the request yields denoise progress up to the last step and then every
decoded temporal chunk (1 frame, then 4 per latent frame) before its final output, and the chunks concatenate
to exactly the final clip; with `stream_video_chunks=False` (the `/v1/videos` job route) only progress comes and
the final output carries the whole clip, so nothing is re-joined; without either, only the final output comes.
A streamed clip crosses the worker -> engine boundary once: its frames come as chunks and the worker's final
output carries none of them again.
"""

from __future__ import annotations

import asyncio

import numpy as np

from vllm_omni.diffusion.video_utils import STREAMED_FRAMES, join_streamed_video
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

PARAMS = {"height": 32, "width": 48, "num_frames": 13, "num_inference_steps": 3, "seed": 0}


async def collect(omni, request_id: str, params: SP) -> list:
    async def run() -> list:
        return [out async for out in omni.generate("A red car.", request_id, [params])]

    return await asyncio.wait_for(run(), 120)


async def streamed_progress_only_and_plain(omni) -> tuple[list, list, list]:
    """One event loop for every request (AsyncOmni's output handler lives on the loop that first used it)."""
    return (await collect(omni, "s1", SP(**PARAMS, stream_partial_outputs=True)),
            await collect(omni, "s2", SP(**PARAMS, stream_partial_outputs=True, stream_video_chunks=False)),
            await collect(omni, "s3", SP(**PARAMS)))


def test_async_omni_streams_progress_and_chunks_that_make_the_clip():
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    omni = AsyncOmni("tiny/wan2.1-t2v")
    try:
        streamed, progress_only, plain = asyncio.run(streamed_progress_only_and_plain(omni))
    finally:
        omni.close()

    *partials, final = streamed
    assert final.finished and not any(out.finished for out in partials)
    steps = [out.multimodal_output["progress"]["step"] for out in partials if "progress" in out.multimodal_output]
    assert steps == sorted(steps) and steps[-1] == 3  # a lagging consumer may see fewer, never out of order
    chunks = [out.multimodal_output for out in partials if "video_chunk" in out.multimodal_output]
    assert [c["video_chunk"].shape[0] for c in chunks] == [1, 4, 4, 4]
    assert [c["frame_start"] for c in chunks] == [0, 1, 5, 9] and all(c["fps"] == 16 for c in chunks)
    first_chunk = next(i for i, out in enumerate(partials) if "video_chunk" in out.multimodal_output)
    assert all("progress" in out.multimodal_output for out in partials[:first_chunk])
    assert final.multimodal_output == {STREAMED_FRAMES: 13, "fps": 16}  # the chunks are not joined for us
    video = join_streamed_video(final.multimodal_output, [c["video_chunk"] for c in chunks])["video"]
    assert np.array_equal(np.concatenate([c["video_chunk"] for c in chunks]), video)
    assert [out.finished for out in plain] == [True]
    assert np.array_equal(np.asarray(plain[0].multimodal_output["video"]), video)
    # Progress only (what the job route asks for): every partial is a progress report, no frame chunk reaches
    # the caller, and the final output is the whole clip, once.
    *partials, final = progress_only
    assert partials and all(set(out.multimodal_output) == {"progress"} for out in partials)
    assert partials[-1].multimodal_output["progress"]["step"] == 3
    assert STREAMED_FRAMES not in final.multimodal_output
    assert np.array_equal(np.asarray(final.multimodal_output["video"]), video)


def test_a_streamed_clip_crosses_the_worker_boundary_once(wan21_t2v_dir):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest

    engine = DiffusionEngine(OmniDiffusionConfig(model=str(wan21_t2v_dir)))
    try:
        partials = []  # appended on the engine's result thread, all before the future resolves
        streamed = engine.submit(OmniDiffusionRequest("A red car.", SP(**PARAMS, stream_partial_outputs=True), "s"),
                                 on_partial=partials.append).result(timeout=120)
        plain = engine.submit(OmniDiffusionRequest("A red car.", SP(**PARAMS), "p")).result(timeout=120)
    finally:
        engine.close()
    assert streamed.error is None and plain.error is None
    chunks = [p.data["video"] for p in partials if p.kind == "video_chunk"]
    clip = plain.output["video"]
    # What crossed for the streamed request: every frame once, in chunks, and no frame in its final output.
    assert sum(c.shape[0] for c in chunks) == PARAMS["num_frames"] == clip.shape[0]
    assert sum(c.nbytes for c in chunks) == clip.nbytes
    assert "video" not in streamed.output and streamed.output == {STREAMED_FRAMES: PARAMS["num_frames"], "fps": 16}
    assert np.array_equal(join_streamed_video(streamed.output, chunks)["video"], clip)
