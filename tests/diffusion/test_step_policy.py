"""Step scheduling policies (`--diffusion-scheduler-policy`): admission order, step slots and preemption.

Pins: fcfs never pauses a resident state; under priority and slo a more urgent arrival takes a step slot at the
next boundary and the paused state resumes later with exactly (bitwise) its solo output, because it kept its
latents and scheduler; slo serves the earliest deadline first and puts a request that can no longer make its
deadline behind those that can; at most `max_paused_states` states are paused; per-shape step costs are learned;
request mode orders its queue by the same policy; the knobs are validated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_diffusion_scheduler import next_batch, request_scheduler
from test_step_execution import Harness, make, solo

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.config import StageConfigFactory
from vllm_omni.diffusion.core.policy import StepCostModel, StepPolicy, shape_key
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli import docs
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline


@pytest.fixture(scope="module")
def pipe(dist_world):
    model_dir = build_tiny("qwen-image")
    return QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir,
                                             torch.device("cpu"), torch.float32)


def harness(pipe, policy: str, max_num_seqs: int = 1, **config) -> Harness:
    h = Harness(pipe, max_num_seqs=max_num_seqs)
    h.executor.runner.od_config = OmniDiffusionConfig(model="tiny", max_num_seqs=max_num_seqs,
                                                      diffusion_scheduler_policy=policy, **config)
    h.executor.policy = StepPolicy(policy)
    return h


def request(rid: str, steps: int, seed: int, **sp) -> OmniDiffusionRequest:
    r = make("qwen-image", rid, steps=steps, seed=seed, cfg=False)
    for name, value in sp.items():
        setattr(r.sampling_params, name, value)
    return r


def resident_ids(h: Harness) -> list[str]:
    return [job.request.request_id for job in h.executor.resident]


def test_fcfs_never_pauses(pipe):
    h = harness(pipe, "fcfs")
    h.add(request("first", 4, 1, priority=5))
    h.round()
    h.add(request("urgent", 2, 2, priority=-5))
    h.round()
    assert resident_ids(h) == ["first"] and not h.executor.paused
    h.drain()
    assert h.finished_at["first"] < h.finished_at["urgent"]
    assert h.outputs["first"].step_stats.preemptions == 0


def test_priority_preempts_and_the_paused_state_resumes_bitwise(pipe):
    h = harness(pipe, "priority")
    low = request("low", 5, 1, priority=1)
    high = request("high", 2, 2, priority=0)
    h.add(low)
    h.round()
    h.round()
    h.add(high)
    h.round()  # high takes the only slot; low is paused at step 2 with its latents
    assert resident_ids(h) == ["high"]
    assert [job.request.request_id for job in h.executor.paused] == ["low"]
    assert h.executor.paused[0].state.step_index == 2
    h.drain()
    assert h.finished_at["high"] < h.finished_at["low"]
    assert h.outputs["low"].step_stats.preemptions == 1
    assert len(h.outputs["low"].step_stats.step_seconds) == 5  # no step recomputed
    for r in (low, high):
        np.testing.assert_array_equal(np.asarray(h.outputs[r.request_id].output), solo(pipe, r))


def test_equal_priority_keeps_arrival_order(pipe):
    h = harness(pipe, "priority")
    h.add(request("a", 3, 1))
    h.round()
    h.add(request("b", 2, 2))
    h.drain()
    assert h.finished_at["a"] < h.finished_at["b"] and h.outputs["a"].step_stats.preemptions == 0


def test_slo_serves_the_earliest_deadline_first_and_counts_misses(pipe):
    h = harness(pipe, "slo", default_deadline_ms=600_000)
    h.add(request("relaxed", 4, 1))  # the default deadline
    h.round()
    h.add(request("tight", 2, 2, deadline_ms=30_000))
    h.add(request("hopeless", 2, 3, deadline_ms=1))  # cannot make it: goes last
    h.round()
    assert resident_ids(h) == ["tight"]
    h.drain()
    assert h.finished_at["tight"] < h.finished_at["relaxed"] < h.finished_at["hopeless"]
    assert h.outputs["hopeless"].step_stats.deadline_missed
    assert not h.outputs["tight"].step_stats.deadline_missed
    assert h.outputs["relaxed"].step_stats.preemptions == 1


def test_slo_steps_one_shape_at_a_time_and_learns_what_cobatching_costs(pipe):
    h = harness(pipe, "slo", max_num_seqs=3)
    small = [request(f"s{i}", 3, i, deadline_ms=60_000 + i) for i in range(2)]
    big = make("qwen-image", "big", steps=3, seed=9, cfg=False, size=64)
    big.sampling_params.deadline_ms = 120_000
    for r in (*small, big):
        h.add(r)
    h.round()
    assert resident_ids(h) == ["s0"]  # alone: the shape's solo step is not measured yet
    h.round()
    assert resident_ids(h) == ["s0", "s1"]  # the same shape: co-batched once, to measure what it costs
    assert [j.request.request_id for j in h.executor.waiting] == ["big"]  # another shape waits: no sharing
    cost, key = h.executor.policy.cost, shape_key(small[0])
    assert cost.measured(key, 1) is not None and cost.measured(key, 2) is not None
    h.drain()
    assert max(h.finished_at["s0"], h.finished_at["s1"]) < h.finished_at["big"]
    assert h.outputs["big"].step_stats.preemptions == 0
    for r in (*small, big):
        np.testing.assert_allclose(np.asarray(h.outputs[r.request_id].output), solo(pipe, r), atol=1e-5)


def test_paused_states_are_bounded_by_max_paused_states(pipe):
    h = harness(pipe, "priority", max_paused_states=1)
    for i, prio in enumerate((3, 2, 1)):  # each arrival is more urgent than everything before
        h.add(request(f"r{i}", 6, i, priority=prio))
        h.round()
    assert resident_ids(h) == ["r1"] and [j.request.request_id for j in h.executor.paused] == ["r0"]
    assert [j.request.request_id for j in h.executor.waiting] == ["r2"]  # one paused state at most
    h.drain()
    assert all(h.outputs[f"r{i}"].error is None for i in range(3))


def test_aborting_a_paused_state_frees_it(pipe):
    h = harness(pipe, "priority")
    h.add(request("paused", 6, 1, priority=1))
    h.round()
    h.add(request("urgent", 2, 2, priority=0))
    h.round()
    h.abort("paused")
    h.round()
    assert h.outputs["paused"].error_status_code == 499 and not h.executor.paused
    h.drain()
    assert h.outputs["urgent"].error is None


def test_step_costs_are_learned_per_shape_and_scaled_to_new_shapes():
    cost = StepCostModel(alpha=0.5)
    small = shape_key(OmniDiffusionRequest("x", SP(width=32, height=32), "a"))
    big = shape_key(OmniDiffusionRequest("x", SP(width=64, height=64), "b"))
    assert cost.step_seconds(small) == 0.0
    cost.observe(small, 1.0)
    cost.observe(small, 2.0)
    assert cost.step_seconds(small) == pytest.approx(1.5)
    assert cost.step_seconds(big) == pytest.approx(6.0)  # 4x the pixels


def test_request_mode_orders_its_queue_by_the_policy():
    def req(rid, **sp):
        return OmniDiffusionRequest("p", SP(height=64, **sp), rid)

    sched = request_scheduler(max_num_seqs=1, diffusion_scheduler_policy="priority")
    for rid, prio in (("a", 2), ("b", 0), ("c", 0)):
        sched.add(req(rid, priority=prio), now=0.0)
    assert [next_batch(sched, now=1.0)[0][0].request_id for _ in range(3)] == ["b", "c", "a"]
    sched = request_scheduler(max_num_seqs=1, diffusion_scheduler_policy="slo", default_deadline_ms=1000)
    sched.add(req("default"), now=0.0)  # due at 1.0
    sched.add(req("tight", deadline_ms=100), now=0.5)  # due at 0.6
    assert next_batch(sched, now=0.6)[0][0].request_id == "tight"


def test_knobs_are_validated():
    for bad in ({"deadline_ms": 0}, {"deadline_ms": -5.0}, {"deadline_ms": 1e12}, {"priority": 2**64},
                {"priority": 1.5}):
        with pytest.raises(OmniClientError) as info:
            SP(**bad)
        assert info.value.param == next(iter(bad))
    with pytest.raises(ValueError, match="default_deadline_ms"):
        OmniDiffusionConfig(model="m", default_deadline_ms=0)
    with pytest.raises(ValueError, match="diffusion_scheduler_policy"):
        StepPolicy("lifo")


def test_policy_knobs_reach_the_stage_config():
    parser = docs.serve_parser()
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--diffusion-scheduler-policy", "slo",
                              "--default-deadline-ms", "5000"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    for source in (kwargs, {"diffusion_scheduler_policy": "slo", "default_deadline_ms": 5000.0}):  # CLI, Omni(...)
        (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **source).stages
        od = stage.make_od_config()
        assert od.diffusion_scheduler_policy == "slo" and od.default_deadline_ms == 5000.0


def test_slo_starvation_bound_and_encode_decode_costs_reach_the_executor(pipe):
    h = Harness(pipe, max_num_seqs=1, diffusion_scheduler_policy="slo", slo_starvation_factor=2.0)
    assert h.executor.policy.starvation_factor == 2.0
    r = request("one", 2, 1)
    h.add(r)
    h.drain()
    cost, key = h.executor.policy.cost, shape_key(r)
    assert cost.phase_seconds(key, "encode") > 0 and cost.phase_seconds(key, "decode") > 0  # measured, per shape
    parser = docs.serve_parser()
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--slo-starvation-factor", "0.5"])
    (stage,) = StageConfigFactory.create_from_model(
        "tiny/qwen-image", **OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))).stages
    assert stage.make_od_config().slo_starvation_factor == 0.5
    with pytest.raises(ValueError, match="slo_starvation_factor"):
        OmniDiffusionConfig(model="m", slo_starvation_factor=-1.0)
