"""The engine's step scheduler on its own (no pipeline, no worker): plans out, results in.

Pins: a plan crosses the engine-worker boundary encoded and decodes to the same plan; memory admission keeps a
newcomer waiting (in its place) until it fits; an abort drops a waiting request at once and a resident one in
the next plan only; a request aborted while its last round runs is not dropped again; the cost model learns
from the round's forwards.
"""

from __future__ import annotations

import msgspec

from vllm_omni.diffusion.core.policy import shape_key
from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import EncodedStepPlan, MsgCodec, StepResult, WorkerInput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


def request(rid: str, steps: int = 2) -> OmniDiffusionRequest:
    return OmniDiffusionRequest({"prompt": rid}, SP(num_inference_steps=steps, height=32, width=32), rid)


def scheduler(**config) -> DiffusionScheduler:
    return DiffusionScheduler(OmniDiffusionConfig(model="m", step_execution=True, **config))


def result(plan, outputs=(), progress=None, forwards=()) -> StepResult:
    return StepResult(plan.round_id, 0, outputs={rid: DiffusionOutput(output=rid) for rid in outputs},
                      progress=progress or {}, forwards=list(forwards))


def test_a_plan_decodes_on_the_worker_as_the_engine_made_it():
    s = scheduler(max_num_seqs=2)
    s.add(request("a"), stream=True)
    s.add(request("b"))
    plan = s.schedule()
    codec = MsgCodec(None, "vllm_omni_test_")
    encoded = EncodedStepPlan(plan.round_id, [msgspec.Raw(codec.encode(r)) for r in plan.new], plan.stream,
                              plan.step, plan.abort)
    decoded = MsgCodec(WorkerInput, "vllm_omni_test_").decoder().decode(codec.encode(encoded))
    assert decoded == plan and [r.request_id for r in decoded.new] == ["a", "b"] and decoded.stream == ["a"]


def test_memory_admission_keeps_a_newcomer_waiting_until_it_fits():
    s = scheduler(max_num_seqs=4)
    s.add(request("a"))
    s.add(request("b"))
    plan = s.schedule(fits=lambda requests: len(requests) == 1)
    assert plan.step == ["a"] and [j.request_id for j in s.waiting] == ["b"]
    s.update(plan, result(plan, progress={"a": (1, 2)}))
    plan = s.schedule(fits=lambda requests: True)
    assert [r.request_id for r in plan.new] == ["b"] and plan.step == ["a", "b"]


def test_abort_drops_waiting_at_once_and_resident_in_the_next_plan():
    s = scheduler(max_num_seqs=1)
    s.add(request("a"))
    s.add(request("w"))
    plan = s.schedule()
    assert [job.request_id for job in s.abort(["w", "a"])] == ["w"]  # w never reached the workers
    s.update(plan, result(plan, progress={"a": (1, 2)}))
    plan = s.schedule()
    assert plan.abort == ["a"] and plan.step == [] and s.has_work
    left = s.update(plan, result(plan, outputs=["a"]))
    assert [job.request_id for job, _ in left] == ["a"] and not s.has_work


def test_a_request_aborted_during_its_last_round_is_not_dropped_again():
    s = scheduler(max_num_seqs=1)
    s.add(request("a", steps=1))
    plan = s.schedule()
    s.abort(["a"])  # while the round runs
    assert [job.request_id for job, _ in s.update(plan, result(plan, outputs=["a"]))] == ["a"]
    assert not s.has_work


def test_the_cost_model_learns_from_the_rounds_forwards():
    s = scheduler(max_num_seqs=2)
    s.add(request("a", steps=3))
    s.add(request("b", steps=3))
    plan = s.schedule()
    s.update(plan, result(plan, progress={"a": (1, 3), "b": (1, 3)}, forwards=[(["a", "b"], 0.5)]))
    assert s.policy.cost.measured(shape_key(request("a")), 2) == 0.5
    assert [job.remaining_steps for job in s.resident] == [2, 2]
