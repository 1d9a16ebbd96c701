"""Partial outputs (denoise progress, decoded video chunks) from real worker processes through DiffusionEngine.

What it pins: a request submitted with `on_partial` gets every partial, in order, before its future resolves
(so none is lost or overtakes the final output); a co-batched request without a callback gets none; chunks
large enough for shared memory arrive intact and leave no segment behind.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from fake_pipelines import class_path
from fake_streaming_pipeline import CHUNK_FRAMES, NUM_STEPS, FakeStreamingPipeline, fake_clip

from vllm_omni.diffusion.core.client import RequestStream
from vllm_omni.diffusion.core.messages import CoreFinal, CorePartial
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

TIMEOUT = 60


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = OmniDiffusionConfig(model=str(tmp_path_factory.mktemp("fake")),
                                 model_class_name=class_path(FakeStreamingPipeline),
                                 max_num_seqs=2, request_batch_max_wait_ms=300)
    engine = DiffusionEngine(config)
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(engine.executor.shm_prefix)]


class Recorder:
    """Collects partials and marks when the final output resolved, from whatever thread calls it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def on_partial(self, partial) -> None:
        with self.lock:
            self.events.append((partial.kind, partial.data))

    def on_done(self, _future) -> None:
        with self.lock:
            self.events.append(("final", {}))


def submit(engine, rid: str, prompt: str, seed: int, recorder: Recorder | None):
    request = OmniDiffusionRequest(prompt=prompt, sampling_params=SP(seed=seed), request_id=rid)
    future = engine.submit(request, on_partial=recorder.on_partial if recorder else None)
    if recorder is not None:
        future.add_done_callback(recorder.on_done)
    return future


def test_partials_arrive_in_order_before_the_final_output(engine):
    streamed, plain = Recorder(), Recorder()
    f1 = submit(engine, "p1", "a cat", 1, streamed)
    f2 = submit(engine, "p2", "a dog", 2, None)
    out1, out2 = f1.result(TIMEOUT), f2.result(TIMEOUT)
    assert engine.stats()["batch_sizes"].get(2, 0) >= 1  # co-batched: one streams, the other does not

    kinds = [kind for kind, _ in streamed.events]
    assert kinds == ["progress"] * NUM_STEPS + ["video_chunk"] * len(CHUNK_FRAMES) + ["final"]
    assert [d["step"] for k, d in streamed.events if k == "progress"] == list(range(1, NUM_STEPS + 1))
    chunks = [d for k, d in streamed.events if k == "video_chunk"]
    assert [c["frame_start"] for c in chunks] == [0, 1, 5]
    assert [c["video"].shape[0] for c in chunks] == list(CHUNK_FRAMES)
    clip = np.concatenate([c["video"] for c in chunks])
    assert np.array_equal(clip, fake_clip(1, "a cat")) and np.array_equal(out1.output["video"], clip)
    assert np.array_equal(out2.output["video"], fake_clip(2, "a dog"))
    assert plain.events == []


def test_failed_request_still_gets_its_partials_first(engine):
    recorder = Recorder()
    out = submit(engine, "pf", "stream-fail", 3, recorder).result(TIMEOUT)
    assert out.error and out.error_status_code == 422
    assert [k for k, _ in recorder.events][-1] == "final" and len(recorder.events) == NUM_STEPS + 4


def test_aborted_request_gets_no_more_partials(engine):
    recorder = Recorder()
    blocker = submit(engine, "pb", "a cat", 4, None)
    future = submit(engine, "pa", "a cat", 5, recorder)
    engine.abort(["pa"])
    after_abort = len(recorder.events) - 1  # the cancelled future's "final" came from inside `abort`
    blocker.result(TIMEOUT)
    assert future.cancelled() and recorder.events[after_abort] == ("final", {})
    assert len(recorder.events) == after_abort + 1  # a partial sent before the abort may have come, none after


def test_partial_stream_keeps_chunks_and_coalesces_lagging_progress():
    """What the control plane's side does with partials while its consumer lags (no engine needed)."""
    async def run() -> list:
        stream = RequestStream()
        for step in (1, 2, 3):
            stream.put(CorePartial("r", "progress", {"step": step, "total": 4}))
        stream.put(CorePartial("r", "video_chunk", {"video": np.zeros((1, 2, 2, 3), np.uint8)}))
        stream.put(CorePartial("r", "progress", {"step": 4, "total": 4}))
        stream.finish(CoreFinal("r"))
        return [(p.kind, p.data.get("step")) async for p in stream.partials()]

    assert asyncio.run(run()) == [("progress", 3), ("video_chunk", None), ("progress", 4)]
