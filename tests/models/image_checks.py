"""Checks the native text-to-image family tests share (Z-Image, FLUX.2): PSNR of images on the 0-255 scale,
one request through `forward`, step-mode co-batching against solo runs (`step_cobatched` also steps LTX-2's clips),
and TeaCache's quality contract."""

from __future__ import annotations

import base64
import io

import numpy as np

from tests.diffusion.step_harness import Harness
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch


def psnr(a, b) -> float:
    """PSNR in dB of two images on the 0-255 scale."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def pixels(b64: str) -> np.ndarray:
    """The pixels of a base64 image of an Images API response."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.float64)


def run(pipe, req: OmniDiffusionRequest) -> DiffusionOutput:
    (out,) = pipe.forward(DiffusionRequestBatch([req]))
    assert out.error is None, out.error
    return out


def step_cobatched(pipe, reqs: list[OmniDiffusionRequest], max_num_seqs: int = 4
                   ) -> tuple[dict[str, DiffusionOutput], list[int]]:
    """Steps `reqs` in step mode (the first alone for a round, then the rest join it mid-flight); (each request's
    output by id, the number of inputs of every transformer forward)."""
    forwards: list[int] = []
    forward = pipe.forward_step_inputs

    def logged(inputs, states):
        forwards.append(len(inputs))
        return forward(inputs, states)

    pipe.forward_step_inputs = logged
    try:
        harness = Harness(pipe, max_num_seqs=max_num_seqs)
        harness.add(reqs[0])
        harness.round()
        for req in reqs[1:]:
            harness.add(req)
        harness.drain()
    finally:
        del pipe.forward_step_inputs
    for req in reqs:
        assert harness.outputs[req.request_id].error is None, harness.outputs[req.request_id].error
    return harness.outputs, forwards


def cobatched_forwards(pipe, reqs: list[OmniDiffusionRequest], max_num_seqs: int = 4) -> list[int]:
    """`step_cobatched`, checking each request ends with its solo output (>= 60 dB); the forwards' input counts."""
    outputs, forwards = step_cobatched(pipe, reqs, max_num_seqs)
    for req in reqs:
        assert psnr(outputs[req.request_id].output[0] * 255, run(pipe, req).output[0] * 255) >= 60.0
    return forwards


def check_lossless_and_high(plain, cached, make_request) -> tuple[DiffusionOutput, DiffusionOutput]:
    """`quality="lossless"` on the TeaCache pipeline `cached` is bitwise `plain`'s output; `high` reuses one of
    the 5 steps and changes the image. `make_request(**params)` builds the 5-step request. Returns (high, plain)."""
    reference = run(plain, make_request())
    lossless = run(cached, make_request(quality="lossless"))
    np.testing.assert_array_equal(lossless.output[0], reference.output[0])
    high = run(cached, make_request(quality="high"))
    info = high.extra["cache"]
    assert (info["backend"], info["computed_steps"], info["reused_steps"]) == ("tea_cache", 4, 1)
    assert not np.array_equal(high.output[0], reference.output[0])
    return high, reference
