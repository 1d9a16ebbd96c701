"""The generic diffusers adapter, end to end: real worker process, real diffusers pipeline, tiny weights.

What it pins: through our runtime a diffusers pipeline gives exactly the pixels plain diffusers gives with
the same seed (single and multiple outputs per prompt); a parameter the pipeline does not accept is a 422
naming it; the engine reports the model's class and modality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

MODEL = "tiny/qwen-image"
PROMPT = {"prompt": "a cat holding a sign that says hello world", "negative_prompt": "blurry"}
COMMON = {"height": 64, "width": 64, "num_inference_steps": 4, "true_cfg_scale": 4.0}


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(OmniDiffusionConfig(model=MODEL, use_diffusers_adapter=True))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference():
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(build_tiny(MODEL), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_adapter_matches_diffusers_exactly(engine, reference):
    out = engine.submit(OmniDiffusionRequest(PROMPT, SP(seed=42, **COMMON), "same-seed")).result(120)
    assert out.error is None, out.error
    expected = reference(**PROMPT, **COMMON, generator=torch.Generator("cpu").manual_seed(42)).images
    assert len(out.output) == 1 and out.output[0].size == (64, 64)
    assert np.array_equal(np.asarray(out.output[0]), np.asarray(expected[0]))
    assert {"pipeline", "forward", "queue"} <= set(out.stage_durations)


def test_adapter_multiple_outputs_per_prompt(engine, reference):
    sp = SP(seed=7, num_outputs_per_prompt=2, **COMMON)
    out = engine.submit(OmniDiffusionRequest(PROMPT, sp, "two-images")).result(120)
    expected = reference(**PROMPT, **COMMON, num_images_per_prompt=2,
                         generator=torch.Generator("cpu").manual_seed(7)).images
    assert len(out.output) == 2
    for got, want in zip(out.output, expected, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_unsupported_parameter_is_422_naming_it(engine):
    out = engine.submit(OmniDiffusionRequest("a cat", SP(num_frames=8, **COMMON), "bad-param")).result(120)
    assert out.error_status_code == 422 and "num_frames" in out.error
    ok = engine.submit(OmniDiffusionRequest("a cat", SP(seed=1, **COMMON), "after-bad")).result(120)
    assert ok.error is None


def test_engine_metadata(engine):
    assert engine.model_class_name == "QwenImagePipeline"
    assert engine.output_modality == "image" and not engine.supports_request_batch


def test_adapter_progress_and_abort_through_step_callback(reference):
    """Through diffusers' public `callback_on_step_end`: progress for every step; a request aborted during step 2
    stops there (no VAE decode), one aborted before it starts never runs; the next request is unaffected."""
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.models.diffusers_adapter.pipeline import DiffusersAdapterPipeline

    od_config = OmniDiffusionConfig(model=MODEL, use_diffusers_adapter=True)
    adapter = DiffusersAdapterPipeline(reference, od_config)
    steps: list[tuple[str, int]] = []
    aborted = {"never"}

    def sink(request_id: str, kind: str, data: dict) -> None:
        steps.append((request_id, data["step"]))
        if request_id == "stop" and data["step"] == 2:
            aborted.add(request_id)

    decodes = []
    decode = reference.vae.decode
    reference.vae.decode = lambda *a, **k: decodes.append(1) or decode(*a, **k)
    requests = [OmniDiffusionRequest(PROMPT, SP(seed=seed, **COMMON), rid)
                for seed, rid in enumerate(("never", "stop", "ok"))]
    ctx = StepContext(od_config, request_ids=[r.request_id for r in requests], partial_sink=sink,
                      abort_requested=aborted.__contains__)
    try:
        never, stop, ok = adapter.forward(DiffusionRequestBatch(requests), ctx)
    finally:
        del reference.vae.decode
    for out in (never, stop):
        assert (out.error, out.error_status_code, out.error_type) == ("request aborted", 499, "aborted")
    assert steps == [("stop", 1), ("stop", 2)] + [("ok", s) for s in range(1, COMMON["num_inference_steps"] + 1)]
    assert len(decodes) == 1
    expected = reference(**PROMPT, **COMMON, generator=torch.Generator("cpu").manual_seed(2)).images
    assert np.array_equal(np.asarray(ok.output[0]), np.asarray(expected[0]))
