"""DiffusionEngine contract (contract 3) on real worker processes with a stand-in pipeline.

What it pins: compatible requests share one forward and incompatible ones do not; a failing request fails
alone; invalid input is an OmniClientError naming the field; abort drops queued work; big outputs travel
through shared memory and leave no segment behind; collective_rpc and sleep/wake reach the workers.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fake_pipelines import FakeBatchPipeline, FakeSingleRequestPipeline, class_path, fake_image

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

TIMEOUT = 60


def request(rid: str, prompt: str | dict = "a cat", **sp) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt=prompt, sampling_params=SP(**sp), request_id=rid)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = OmniDiffusionConfig(
        model=str(tmp_path_factory.mktemp("fake")),
        model_class_name=class_path(FakeBatchPipeline),
        max_num_seqs=4,
        request_batch_max_wait_ms=300,
    )
    engine = DiffusionEngine(config)
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)


def run_together(engine: DiffusionEngine, requests: list[OmniDiffusionRequest]):
    futures = [engine.submit(r) for r in requests]
    return [f.result(TIMEOUT) for f in futures]


def test_compatible_requests_share_one_forward(engine):
    before = engine.stats()
    start = time.perf_counter()
    outs = run_together(engine, [request("c1", seed=1, height=16), request("c2", seed=2, height=16)])
    elapsed = time.perf_counter() - start
    after = engine.stats()
    assert after["num_forwards"] - before["num_forwards"] == 1
    assert after["batch_sizes"].get(2, 0) - before["batch_sizes"].get(2, 0) == 1
    assert [o.extra["batch_size"] for o in outs] == [2, 2]
    # Co-batched requests land where they would alone.
    for out, seed in zip(outs, (1, 2), strict=True):
        assert np.array_equal(np.asarray(out.output[0]), np.asarray(fake_image(seed, "a cat", 16)))
    durations = outs[0].stage_durations
    assert 0 < durations["queue"] < elapsed and 0 < durations["forward"] < elapsed


@pytest.mark.parametrize(
    "a, b",
    [
        ({"height": 16}, {"height": 32}),
        ({"quality": "high"}, {"quality": "lossless"}),
        ({}, {"quality": "lossless"}),
        ({"num_outputs_per_prompt": 1}, {"num_outputs_per_prompt": 2}),
    ],
)
def test_incompatible_requests_do_not_cobatch(engine, a, b):
    before = engine.stats()["num_forwards"]
    outs = run_together(engine, [request("i1", seed=1, **a), request("i2", seed=1, **b)])
    assert engine.stats()["num_forwards"] - before == 2
    assert [o.extra["batch_size"] for o in outs] == [1, 1]


def test_failing_request_fails_alone(engine):
    bad, good = run_together(engine, [request("f1", "fail"), request("f2", "ok")])
    assert bad.error and bad.error_status_code == 422 and bad.output is None
    assert good.error is None and len(good.output) == 1 and good.extra["batch_size"] == 2


def test_batch_that_raises_is_retried_one_by_one(engine):
    bad, good = run_together(engine, [request("b1", "break-batch"), request("b2", "ok")])
    assert "break-batch" in bad.error and bad.error_status_code == 500
    assert good.error is None and good.extra["batch_size"] == 1


def test_invalid_input_is_client_error_naming_field(engine):
    with pytest.raises(OmniClientError) as exc:
        SP(height=3)
    assert exc.value.param == "height"
    with pytest.raises(OmniClientError) as exc:
        engine.submit(OmniDiffusionRequest(prompt=123, sampling_params=SP(), request_id="x1"))
    assert exc.value.param == "prompt"
    with pytest.raises(OmniClientError) as exc:
        engine.submit(OmniDiffusionRequest(prompt="a", sampling_params={"hieght": 64}, request_id="x2"))
    assert exc.value.param == "hieght"
    slow = engine.submit(request("dup", "sleep:0.3"))
    with pytest.raises(OmniClientError) as exc:
        engine.submit(request("dup"))
    assert exc.value.param == "request_id"
    assert slow.result(TIMEOUT).error is None
    # Nothing was lost: the engine still serves.
    assert engine.submit(request("x3")).result(TIMEOUT).error is None


def test_unsendable_request_fails_alone(engine):
    out = engine.submit(request("u1", extra_args={"callback": object()})).result(TIMEOUT)
    assert "cannot send" in out.error and out.error_status_code == 500
    assert engine.submit(request("u2")).result(TIMEOUT).error is None and not engine.is_dead


def test_abort_drops_waiting_request(engine):
    running = engine.submit(request("a1", "sleep:1.0", height=16))
    time.sleep(0.5)  # a1 is now in flight; a2 has another key, so it waits behind it
    waiting = engine.submit(request("a2", height=32))
    engine.abort(["a2"])
    assert waiting.cancelled()
    assert running.result(TIMEOUT).error is None
    assert engine.stats()["num_waiting"] == 0


def test_large_output_travels_through_shm_and_is_unlinked(engine):
    out = engine.submit(request("big", "big")).result(TIMEOUT)
    assert np.array_equal(out.output["array"], np.arange(1_000_000, dtype=np.float32))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(engine.executor.shm_prefix)]


def test_collective_rpc_reaches_every_rank(engine):
    (info,) = engine.collective_rpc("ping", timeout=TIMEOUT)
    assert info["pid"] == engine.executor.processes[0].pid and info["rank"] == 0
    with pytest.raises(RuntimeError, match="unknown diffusion worker method"):
        engine.collective_rpc("load_model", timeout=TIMEOUT)


def test_sleep_and_wake_up(engine):
    (info,) = engine.collective_rpc("sleep", args=(2,), timeout=TIMEOUT)
    assert info["sleep_level"] == 2
    asleep = engine.submit(request("s1")).result(TIMEOUT)
    assert "asleep" in asleep.error
    engine.collective_rpc("wake_up", timeout=TIMEOUT)
    assert engine.submit(request("s2")).result(TIMEOUT).error is None


def test_engine_metadata(engine):
    assert engine.model_class_name == class_path(FakeBatchPipeline)
    assert engine.output_modality == "image"
    assert engine.supports_request_batch and not engine.is_dead


def test_single_request_pipeline_rejects_batching(tmp_path):
    config = OmniDiffusionConfig(model=str(tmp_path), model_class_name=class_path(FakeSingleRequestPipeline),
                                 max_num_seqs=2)
    with pytest.raises(ValueError, match="does not support request-level batching. Use max_num_seqs=1"):
        DiffusionEngine(config)
