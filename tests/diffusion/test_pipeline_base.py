"""The native pipeline skeleton on real tiny pipelines (CPU fp32): abort between denoise steps and progress.

Pins: a request aborted during step k leaves with the aborted error (499) before step k + 1 while the rest of
its batch goes on with only its own rows and ends with the image it gets alone; a request aborted before its
batch starts never reaches the text encoder or the transformer; every step of every request reports progress.
The survivor is compared with its solo run at the tolerance of the batch-vs-solo tests: on CPU fp32 the
transformer's GEMMs round differently at another batch size (~3e-6 for the same request co-batched or alone,
with or without an abort), so bitwise equality with a solo run cannot hold for any co-batched request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = pytest.mark.usefixtures("dist_world")

STEPS = 4
CPU = torch.device("cpu")


def _load(name: str):
    from vllm_omni.models.flux.pipeline import FluxPipeline
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline
    from vllm_omni.models.qwen_image.pipeline_edit import QwenImageEditPipeline

    cls = {"qwen-image": QwenImagePipeline, "qwen-image-edit": QwenImageEditPipeline, "flux": FluxPipeline}[name]
    model_dir = build_tiny(name)
    return cls.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir, CPU, torch.float32)


@pytest.fixture(scope="module")
def pipes():
    return {name: _load(name) for name in ("qwen-image", "qwen-image-edit", "flux")}


def _request(name: str, prompt: str, request_id: str, seed: int, negative: str | None = "blurry"):
    data: dict = {"prompt": prompt}
    if negative is not None:
        data["negative_prompt"] = negative
    if name == "qwen-image-edit":
        pixels = (np.random.RandomState(seed).rand(48, 64, 3) * 255).astype("uint8")
        data["multi_modal_data"] = {"image": Image.fromarray(pixels)}
    cfg = {"true_cfg_scale": 2.5} if name == "flux" else {}
    sp = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=STEPS, seed=seed, output_type="np",
                                     **cfg)
    return OmniDiffusionRequest(data, sp, request_id)


class Recorder:
    """Counts transformer forwards (rows of each) and aborts requests once a given forward has started."""

    def __init__(self, pipe, abort_at: dict[str, int] | None = None) -> None:
        self.pipe, self.abort_at = pipe, abort_at or {}
        self.rows: list[int] = []
        self.aborted: set[str] = set()
        self.events: dict[str, list[tuple[str, dict]]] = {}

    def __enter__(self) -> Recorder:
        forward = self.pipe.transformer.forward

        def counting(x, *args, **kwargs):
            self.aborted |= {rid for rid, step in self.abort_at.items() if step == len(self.rows)}
            self.rows.append(x.shape[0])
            return forward(x, *args, **kwargs)

        self.pipe.transformer.forward = counting
        return self

    def __exit__(self, *exc) -> None:
        del self.pipe.transformer.forward

    def sink(self, request_id: str, kind: str, data: dict) -> None:
        self.events.setdefault(request_id, []).append((kind, data))

    def abort_requested(self, request_id: str) -> bool:
        return request_id in self.aborted


def _run(pipe, requests, recorder: Recorder | None = None):
    """Through the model runner, as the worker calls it."""
    runner = DiffusionModelRunner(pipe.od_config, CPU)
    runner.pipeline = pipe
    kwargs = {} if recorder is None else {"partial_sink": recorder.sink, "abort_requested": recorder.abort_requested}
    return runner.execute_model(DiffusionRequestBatch(list(requests)), **kwargs)


def _assert_aborted(out) -> None:
    assert out.output is None
    assert (out.error, out.error_status_code, out.error_type) == ("request aborted", 499, "aborted")


@pytest.mark.parametrize("step", [0, 2])
def test_abort_at_step_k_drops_only_that_request(pipes, step):
    pipe = pipes["qwen-image"]
    keep, drop = _request("qwen-image", "a red cat", "keep", 7), _request("qwen-image", "an astronaut", "drop", 8)
    with Recorder(pipe, abort_at={"drop": step}) as rec:
        kept, dropped = _run(pipe, [keep, drop], rec)
    _assert_aborted(dropped)
    # 2 requests x (positive + negative) rows up to the step during which the abort came, then only "keep".
    assert rec.rows == [4] * (step + 1) + [2] * (STEPS - step - 1)
    assert [d["step"] for _, d in rec.events["drop"]] == list(range(1, step + 2))
    (alone,) = _run(pipe, [keep])
    assert kept.error is None
    np.testing.assert_allclose(kept.output, alone.output, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen-image-edit", "flux"])
def test_abort_keeps_the_other_rows_of_every_family(pipes, name):
    """Edit (condition-image rows) and FLUX (negatives only for the requests that have one) drop the right rows."""
    pipe = pipes[name]
    drop = _request(name, "make it red", "drop", 1)
    keep = _request(name, "add a small cat", "keep", 2, negative=None if name == "flux" else " ")
    with Recorder(pipe, abort_at={"drop": 1}) as rec:
        dropped, kept = _run(pipe, [drop, keep], rec)
    _assert_aborted(dropped)
    rows_after = 1 if name == "flux" else 2  # FLUX: "keep" has no negative prompt
    assert rec.rows[2:] == [rows_after] * (STEPS - 2) and rec.rows[0] > rows_after
    (alone,) = _run(pipe, [keep])
    np.testing.assert_allclose(kept.output, alone.output, atol=1e-5)


def test_aborted_before_start_never_runs(pipes):
    pipe = pipes["qwen-image"]
    encoded: list[int] = []
    encode = pipe.encode_texts
    pipe.encode_texts = lambda texts, *a, **k: encoded.append(len(texts)) or encode(texts, *a, **k)
    try:
        with Recorder(pipe) as rec:
            rec.aborted = {"gone"}
            gone, ok = _run(pipe, [_request("qwen-image", "a boat", "gone", 1),
                                   _request("qwen-image", "a tree", "ok", 2)], rec)
            (alone_gone,) = _run(pipe, [_request("qwen-image", "a boat", "gone", 1)], rec)
    finally:
        del pipe.encode_texts
    _assert_aborted(gone)
    _assert_aborted(alone_gone)
    assert ok.error is None
    assert encoded == [2]  # "ok"'s prompt and negative only; nothing at all for the lone aborted request
    assert rec.rows == [2] * STEPS
    assert "gone" not in rec.events


@pytest.mark.parametrize("name", ["qwen-image", "qwen-image-edit", "flux"])
def test_progress_for_every_step_of_every_request(pipes, name):
    pipe = pipes[name]
    requests = [_request(name, "a house", "a", 3), _request(name, "a dog on grass", "b", 4)]
    with Recorder(pipe) as rec:
        outputs = _run(pipe, requests, rec)
    assert all(out.error is None for out in outputs)
    expected = [("progress", {"step": s, "total": STEPS}) for s in range(1, STEPS + 1)]
    assert rec.events == {"a": expected, "b": expected}


def test_step_context_tracks_the_running_step(pipes):
    """Step-gated layers read the current step and normalized timestep from the context, reset after the loop."""
    pipe = pipes["qwen-image"]
    ctx = StepContext(pipe.od_config)
    seen: list[tuple[int | None, float | None]] = []
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: seen.append((ctx.step_index, ctx.timestep)) or forward(*a, **k)
    try:
        with torch.inference_mode():
            (out,) = pipe.forward(DiffusionRequestBatch([_request("qwen-image", "a cup", "r", 5)]), ctx)
    finally:
        del pipe.transformer.forward
    assert out.error is None
    assert [s for s, _ in seen] == list(range(STEPS))
    timesteps = [t for _, t in seen]
    assert timesteps[0] == pytest.approx(1.0, abs=0.05) and timesteps == sorted(timesteps, reverse=True)
    assert (ctx.step_index, ctx.timestep) == (None, None)


def test_two_stage_is_refused_where_the_family_has_none(pipes):
    """`two_stage` (LTX-2's variant) and its `refine_lora` are a 400 naming them on a family without one, not
    silently one stage; the request beside it in the batch still runs."""
    pipe = pipes["flux"]
    bad = _request("flux", "a red fox", "two", 1)
    bad.sampling_params.two_stage = True
    refine = _request("flux", "a red fox", "refine", 1)
    refine.sampling_params.refine_lora = {"path": "/loras/distilled.safetensors"}
    good = _request("flux", "a red fox", "one", 1)
    outs = pipe.forward(DiffusionRequestBatch([bad, refine, good]))
    assert outs[0].error_status_code == 400 and outs[0].error_param == "two_stage"
    assert outs[1].error_status_code == 400 and outs[1].error_param == "refine_lora"
    assert outs[2].error is None
