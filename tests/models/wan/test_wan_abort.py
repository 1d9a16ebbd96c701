"""Abort inside a Wan forward: before any denoise step and between VAE decode chunks (the shared skeleton contract).

Why it matters: an aborted request must stop costing work and leave with a 499 (`RequestAbortedError`) while the
requests it was co-batched with go on and give the video they give alone; a streamed request sends no chunk
after its abort.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

SIZE = dict(height=32, width=48, num_frames=13, num_inference_steps=4, max_sequence_length=32, guidance_scale=5.0)


@pytest.fixture(scope="module")
def pipe(dist_world, wan21_t2v_dir):
    from vllm_omni.models.wan.pipeline import WanPipeline

    return WanPipeline.from_pretrained(OmniDiffusionConfig(model=str(wan21_t2v_dir)), wan21_t2v_dir,
                                       torch.device("cpu"), torch.float32)


def make_request(request_id: str, seed: int, streamed: bool = False) -> OmniDiffusionRequest:
    sp = OmniDiffusionSamplingParams(seed=seed, stream_partial_outputs=streamed, **SIZE)
    return OmniDiffusionRequest(f"prompt of {request_id}", sampling_params=sp, request_id=request_id)


class AbortWhen:
    """A partial sink that aborts `victims` once `trigger(request_id, kind, data)` is true (as the worker's
    abort side channel would, between steps); records every partial."""

    def __init__(self, victims, trigger) -> None:
        self.victims, self.trigger = set(victims), trigger
        self.aborted: set[str] = set()
        self.partials: list[tuple[str, str, dict]] = []

    def __call__(self, request_id, kind, data) -> None:
        self.partials.append((request_id, kind, data))
        if self.trigger(request_id, kind, data):
            self.aborted |= self.victims

    def ctx(self, pipe, requests) -> StepContext:
        return StepContext(pipe.od_config, [r.request_id for r in requests], partial_sink=self,
                           abort_requested=self.aborted.__contains__)


def run(pipe, requests, ctx=None):
    with torch.inference_mode():
        return pipe.forward(DiffusionRequestBatch(list(requests)), ctx)


def assert_aborted(out) -> None:
    assert out.error_status_code == 499 and out.error_type == "aborted" and out.output is None


def assert_same_video(got, alone) -> None:
    # Rows computed in a batch of two before the abort and alone after it: equal up to GEMM rounding.
    diff = np.abs(np.asarray(got, dtype=np.int16) - np.asarray(alone, dtype=np.int16))
    assert got.shape == alone.shape and diff.max() <= 2 and diff.mean() < 0.05


def test_abort_between_steps_drops_the_request_and_the_other_goes_on(pipe):
    [alone] = run(pipe, [make_request("r0", 7)])
    requests = [make_request("r0", 7), make_request("r1", 11)]
    sink = AbortWhen({"r1"}, lambda rid, kind, data: kind == "progress" and data["step"] == 2)
    out0, out1 = run(pipe, requests, sink.ctx(pipe, requests))
    assert_aborted(out1)
    assert out0.error is None
    assert_same_video(out0.output["video"], alone.output["video"])
    steps_of_r1 = [d["step"] for rid, kind, d in sink.partials if rid == "r1" and kind == "progress"]
    assert steps_of_r1 == [1, 2]  # no step ran for r1 after its abort


def test_abort_between_decode_chunks_stops_the_streamed_request(pipe):
    [alone] = run(pipe, [make_request("r0", 7)])
    requests = [make_request("r0", 7), make_request("r1", 11, streamed=True)]
    sink = AbortWhen({"r1"}, lambda rid, kind, data: kind == "video_chunk")
    out0, out1 = run(pipe, requests, sink.ctx(pipe, requests))
    assert_aborted(out1)
    chunks = [d for rid, kind, d in sink.partials if kind == "video_chunk"]
    assert [(c["frame_start"], c["video"].shape[0]) for c in chunks] == [(0, 1)]  # nothing after the abort
    assert out0.error is None
    assert_same_video(out0.output["video"], alone.output["video"])


def test_a_group_aborted_during_decode_stops_decoding(pipe):
    requests = [make_request("r0", 7, streamed=True), make_request("r1", 11, streamed=True)]
    sink = AbortWhen({"r0", "r1"}, lambda rid, kind, data: kind == "video_chunk" and data["frame_start"] == 1)
    outs = run(pipe, requests, sink.ctx(pipe, requests))
    for out in outs:
        assert_aborted(out)
    starts = [(rid, d["frame_start"]) for rid, kind, d in sink.partials if kind == "video_chunk"]
    assert starts == [("r0", 0), ("r1", 0), ("r0", 1), ("r1", 1)]  # 2 of the 4 chunks, then decoding stopped
