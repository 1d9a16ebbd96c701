"""Step execution through the real engine and worker processes on tiny Qwen-Image (CPU fp32).

Pins: with `step_execution=True` a request submitted while a long one runs is admitted at the next step and
its result arrives while the long one is still running; every output equals (bitwise) the same request's
output from a request-mode engine, also when concurrent requests share the worker's co-batched forwards; an
abort frees the worker's state within a step or two; a request that raises inside a step fails alone (500,
with its error) and its neighbour is unaffected; a pipeline that cannot step serves in request mode;
`--step-execution --max-num-seqs N`, `--diffusion-max-tokens-per-forward N` and `Omni(...)`-style kwargs
reach the stage's `OmniDiffusionConfig`.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from fake_pipelines import FakeBatchPipeline, class_path
from step_pipelines import FaultyQwenImagePipeline
from test_diffusion_engine_failures import make_engine

from vllm_omni.config import StageConfigFactory
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli import docs
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

MODEL = {"model": "tiny/qwen-image", "model_class_name": class_path(FaultyQwenImagePipeline)}


@pytest.fixture(scope="module")
def step_engine():
    engine = DiffusionEngine(OmniDiffusionConfig(**MODEL, step_execution=True, max_num_seqs=4))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def request_engine():
    engine = DiffusionEngine(OmniDiffusionConfig(**MODEL))
    yield engine
    engine.close()


def make(rid: str, steps: int, seed: int, prompt: str = "a cat holding a sign", cfg: bool = False):
    data = {"prompt": prompt, **({"negative_prompt": "blurry"} if cfg else {})}
    sp = SP(height=32, width=32, num_inference_steps=steps, seed=seed, output_type="np",
            **({"true_cfg_scale": 4.0} if cfg else {}))
    return OmniDiffusionRequest(data, sp, rid)


def started(engine: DiffusionEngine, request: OmniDiffusionRequest):
    """Submit with a progress listener; returns the future and an event set at the first finished step."""
    first_step = threading.Event()
    return engine.submit(request, on_partial=lambda p: first_step.set()), first_step


def assert_same_as_request_mode(request_engine, request: OmniDiffusionRequest, output) -> None:
    assert output.error is None, output.error
    reference = request_engine.submit(make(f"ref-{request.request_id}", request.sampling_params.num_inference_steps,
                                           request.sampling_params.seed, request.prompt_text,
                                           request.negative_prompt is not None)).result(300)
    np.testing.assert_array_equal(np.asarray(output.output), np.asarray(reference.output))


def test_late_request_finishes_while_the_long_one_runs(step_engine, request_engine):
    assert step_engine.step_execution and step_engine.od_config.step_execution
    long_request, short_request = make("long", 40, 1), make("short", 2, 2, "a red car", cfg=True)
    long, long_started = started(step_engine, long_request)
    assert long_started.wait(120)
    short = step_engine.submit(short_request).result(120)
    assert not long.done(), "the short request must not wait behind the long one"
    assert short.stage_durations["step_admission_wait"] < 5.0
    assert_same_as_request_mode(request_engine, short_request, short)
    assert_same_as_request_mode(request_engine, long_request, long.result(300))


def test_abort_frees_the_worker_within_a_step(step_engine, request_engine):
    keep_request = make("keep", 6, 3, cfg=True)
    doomed, doomed_started = started(step_engine, make("doomed", 100_000, 4))
    keep = step_engine.submit(keep_request)
    assert doomed_started.wait(120)
    step_engine.abort(["doomed"])
    assert doomed.cancelled()
    deadline = time.monotonic() + 30
    while "doomed" in step_engine._running:  # until the worker's aborted result came back
        assert time.monotonic() < deadline, "the worker kept the aborted request"
        time.sleep(0.05)
    assert_same_as_request_mode(request_engine, keep_request, keep.result(120))


def test_a_request_failing_inside_a_step_fails_alone(step_engine, request_engine):
    good_request = make("good", 4, 5, cfg=True)
    bad = step_engine.submit(make("bad", 4, 6, "FAIL now"))
    good = step_engine.submit(good_request)
    bad_out = bad.result(120)
    assert bad_out.error_status_code == 500 and "injected fault" in bad_out.error
    assert_same_as_request_mode(request_engine, good_request, good.result(120))
    assert step_engine.submit(make("after", 2, 7)).result(120).error is None  # the worker lives on


def test_a_pipeline_that_cannot_step_serves_in_request_mode(tmp_path, caplog):
    engine = make_engine(tmp_path, FakeBatchPipeline, step_execution=True, max_num_seqs=2)
    try:
        assert not engine.step_execution and not engine.od_config.step_execution
        assert any(r.levelname == "WARNING" and "--step-execution is off" in r.getMessage() for r in caplog.records)
        out = engine.submit(OmniDiffusionRequest("x", SP(num_inference_steps=2, height=16), "r")).result(60)
        assert out.error is None
    finally:
        engine.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_paused_states": 2}, "--max-paused-states applies to step mode only"),
    ({"diffusion_max_tokens_per_forward": 1}, "--diffusion-max-tokens-per-forward applies to step mode only"),
    ({"step_execution": True, "max_paused_states": 2}, "request mode (its pipeline cannot step)"),
    ({"step_execution": True, "request_batch_max_wait_ms": 5.0}, "--request-batch-max-wait-ms applies to request"),
])
def test_a_scheduler_flag_the_stage_mode_has_no_use_for_is_refused(tmp_path, kwargs, message):
    """Refused before any worker starts; the flag's default is accepted in either mode (the tests above)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        if kwargs.get("request_batch_max_wait_ms"):  # needs a pipeline that steps
            DiffusionEngine(OmniDiffusionConfig(**MODEL, **kwargs))
        else:
            make_engine(tmp_path, FakeBatchPipeline, **kwargs)


def test_step_execution_knobs_reach_the_stage_config():
    parser = docs.serve_parser()
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--step-execution", "--max-num-seqs", "4"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    assert kwargs["step_execution"] is True
    for source in (kwargs, {"step_execution": True, "max_num_seqs": 4}):  # CLI, then Omni(...) kwargs
        (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **source).stages
        od = stage.make_od_config()
        assert od.step_execution and od.max_num_seqs == 4
    # step mode runs on several ranks (rank 0 decides each round; see tests/diffusion/distributed/)
    assert OmniDiffusionConfig.from_kwargs(model="m", step_execution=True,
                                           tensor_parallel_size=2).parallel_config.world_size == 2


def test_concurrent_requests_cobatched_in_the_worker_match_request_mode(step_engine, request_engine):
    """Same size, different prompts, seeds, step counts and CFG on/off: resident together in the worker, they
    share its transformer forwards (default token cap) and each still equals its request-mode output."""
    requests = [make("co-a", 4, 11, cfg=True), make("co-b", 2, 12, "a red car"),
                make("co-c", 3, 13, "mountains and a lake at dawn, oil painting", cfg=True)]
    futures = [step_engine.submit(request) for request in requests]
    for request, future in zip(requests, futures, strict=True):
        assert_same_as_request_mode(request_engine, request, future.result(120))


def test_token_cap_knob_reaches_the_stage_config():
    parser = docs.serve_parser()
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--step-execution",
                              "--diffusion-max-tokens-per-forward", "1"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs).stages
    assert stage.make_od_config().diffusion_max_tokens_per_forward == 1
    assert OmniDiffusionConfig(model="m").diffusion_max_tokens_per_forward == 16384
    with pytest.raises(ValueError, match="diffusion_max_tokens_per_forward must be >= 1"):
        OmniDiffusionConfig(model="m", diffusion_max_tokens_per_forward=0)
