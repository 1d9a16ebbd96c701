"""slo admission control (`--slo-admission-control`, `--slo-admission-min-accept`).

Pins: with the flag, a request the cost model predicts cannot finish by its deadline behind the work ahead of it
(queued jobs with earlier deadlines; in request mode the batch in flight too) is refused at `add` with a 429
naming `deadline_ms` and the predicted finish, and nothing of it stays queued; the floor caps refusals (at most
1 - floor of the window's arrivals: one more is admitted and served late); nothing is refused before the cost
model prices the shape, nor without the flag; the CLI flags reach the stage config; the flag with another policy,
or the floor without the flag, is a config error naming the flag; on the real engine a refused request leaves
the engine serving.
"""

from __future__ import annotations

import time

import pytest

from vllm_omni.config import StageConfigFactory
from vllm_omni.diffusion.core.policy import AdmissionControl, StepPolicy, shape_key
from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli import docs
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

TIMEOUT = 60
FAKE = "tests.diffusion.fake_pipelines:FakeBatchPipeline"


def request(rid: str, steps: int, deadline_ms: float, prompt: str = "p", size: int = 32) -> OmniDiffusionRequest:
    sp = SP(width=size, height=size, num_inference_steps=steps, deadline_ms=deadline_ms)
    return OmniDiffusionRequest(prompt, sp, rid)


def scheduler(**config) -> DiffusionScheduler:
    s = DiffusionScheduler(OmniDiffusionConfig(model="m", step_execution=True, diffusion_scheduler_policy="slo",
                                               **config))
    s.policy.cost.observe(shape_key(request("k", 1, 1.0)), 1.0)  # one step: 1 s
    return s


def test_a_request_that_cannot_make_its_deadline_is_refused_within_the_floor():
    s = scheduler(slo_admission_control=True, slo_admission_min_accept=0.5)
    s.add(request("a", 10, 20000), now=0.0)  # 10 s of work, 20 s deadline
    s.add(request("b", 10, 25000), now=0.0)  # behind a: done at 20 s
    with pytest.raises(OmniClientError) as exc:
        s.add(request("c", 10, 25000), now=0.0)  # behind a and b: 30 s
    assert exc.value.status_code == 429 and exc.value.param == "deadline_ms"
    assert "deadline_ms=25000" in exc.value.message and "predicted finish is 30000 ms" in exc.value.message
    with pytest.raises(OmniClientError):
        s.add(request("d", 10, 25000), now=0.0)  # 2 of 4 arrivals refused: the floor 0.5 still holds
    late = s.add(request("e", 10, 25000), now=0.0)  # a 3rd of 5 would break it: admitted, served late
    short = s.add(request("f", 2, 5000), now=0.0)  # an earlier deadline: nothing is ahead of it
    assert [j.request_id for j in s.waiting] == ["a", "b", "e", "f"] and late.deadline_ms == 25000
    assert s.num_refused == 2 and short.deadline_ms == 5000
    s.add(request("c", 1, 60000), now=0.0)  # a refused id was never queued: it can come again


def test_the_floor_counts_the_last_window_of_arrivals():
    policy = StepPolicy("slo")
    policy.cost.observe(shape_key(request("k", 1, 1.0)), 1.0)
    control = AdmissionControl(min_accept=0.9, window=10)
    hopeless = [type("Job", (), {"request": request(f"h{i}", 10, 1.0), "deadline": 0.001, "remaining_steps": 10,
                                 "prepared": False})() for i in range(30)]
    refused = [control.refuse(policy, [], job, 0.0) is not None for job in hopeless]
    assert refused.count(True) == 3 and all(refused[i] for i in (9, 19, 29))  # 1 of every 10: never more
    with pytest.raises(ValueError, match="slo_admission_min_accept"):
        AdmissionControl(min_accept=1.5)


def test_nothing_is_refused_without_the_flag_or_before_the_cost_model_prices_it():
    s = scheduler()
    assert s.admission is None
    for i in range(5):
        s.add(request(f"r{i}", 10, 1000), now=0.0)
    unpriced = DiffusionScheduler(OmniDiffusionConfig(model="m", diffusion_scheduler_policy="slo",
                                                      slo_admission_control=True, slo_admission_min_accept=0.5))
    for i in range(5):
        unpriced.add(request(f"r{i}", 10, 1000), now=0.0)
    assert s.num_refused == unpriced.num_refused == 0 and len(unpriced.waiting) == 5


def test_the_flags_reach_the_stage_config_and_need_slo():
    parser = docs.serve_parser()
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--diffusion-scheduler-policy", "slo",
                              "--slo-admission-control", "--slo-admission-min-accept", "0.8"])
    (stage,) = StageConfigFactory.create_from_model(
        "tiny/qwen-image", **OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))).stages
    od = stage.make_od_config()
    assert od.slo_admission_control and od.slo_admission_min_accept == 0.8
    assert DiffusionScheduler(od).admission.min_accept == 0.8
    with pytest.raises(ValueError, match="--slo-admission-control"):
        OmniDiffusionConfig(model="m", diffusion_scheduler_policy="fcfs", slo_admission_control=True)
    with pytest.raises(ValueError, match="--slo-admission-min-accept"):
        OmniDiffusionConfig(model="m", diffusion_scheduler_policy="slo", slo_admission_min_accept=0.5)
    with pytest.raises(ValueError, match="slo_admission_min_accept must be in"):
        OmniDiffusionConfig(model="m", diffusion_scheduler_policy="slo", slo_admission_control=True,
                            slo_admission_min_accept=0.0)


def test_the_engine_refuses_behind_its_batch_in_flight_and_keeps_serving(tmp_path):
    """Request mode: the batch in flight is never preempted, so it is ahead of every newcomer."""
    engine = DiffusionEngine(OmniDiffusionConfig(
        model=str(tmp_path), model_class_name=FAKE, max_num_seqs=1,
        diffusion_scheduler_policy="slo", slo_admission_control=True, slo_admission_min_accept=0.5))
    try:
        engine.scheduler.policy.cost.observe(shape_key(request("k", 1, 1.0, size=16)), 1.0)
        hold = engine.submit(request("hold", 2, 60000, prompt="sleep:1", size=16))
        deadline = time.monotonic() + TIMEOUT
        while engine.stats()["num_running"] == 0:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.01)
        with pytest.raises(OmniClientError) as exc:
            engine.submit(request("urgent", 2, 3000, size=16))  # 2 s behind the 2 s in flight
        assert exc.value.status_code == 429 and exc.value.param == "deadline_ms"
        late = engine.submit(request("late", 2, 3000, size=16))  # the floor: 1 of 2 refused is the most
        assert hold.result(TIMEOUT).error is None and late.result(TIMEOUT).error is None
        assert engine.stats()["num_refused"] == 1
    finally:
        engine.close()
