"""Request-batch scheduling (request mode's policy of the one `DiffusionScheduler`), driven with an explicit clock.

What it pins: requests with equal sampling-params keys co-batch (different seeds included) up to
max_num_seqs, and so do requests with different LoRA adapters (each row runs its own), except in a distributed-
layerwise-offload wave (its ranks run their own requests: one adapter set per wave); different size, steps,
CFG, negative-prompt presence or quality (None vs "lossless" too) never co-batch; an unfilled batch waits at
most request_batch_max_wait_ms; FIFO across keys; abort.
"""

from __future__ import annotations

import pytest

from vllm_omni.diffusion.core.batch_key import build_request_batch_sampling_params_key
from vllm_omni.diffusion.core.policy import shape_key
from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import StepResult
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


def req(rid: str, prompt="a cat", **sp) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, SP(**sp), rid)


def ids(batch) -> list[str]:
    return [r.request_id for r in batch]


def request_scheduler(**config) -> DiffusionScheduler:
    return DiffusionScheduler(OmniDiffusionConfig.from_kwargs(model="m", **config))


def next_batch(sched: DiffusionScheduler, now: float, fits=None) -> tuple[list[OmniDiffusionRequest], float | None]:
    """The batch the scheduler sends next and how long a batch that is not full still waits; the batch leaves at
    once (request mode never schedules beside a batch in flight)."""
    plan = sched.schedule(now=now, fits=fits)
    if plan.step:
        assert sched.schedule(now=now).step == []  # nothing beside a batch in flight
        sched.update(plan, StepResult(plan.round_id, 0, outputs={rid: DiffusionOutput() for rid in plan.step}))
    return plan.new, sched.due


def test_different_seeds_and_prompts_share_a_key():
    a = build_request_batch_sampling_params_key(req("a", "x", seed=1))
    b = build_request_batch_sampling_params_key(req("b", "y", seed=2))
    assert a == b


def test_different_loras_share_a_key():
    loras = [None, {"name": "a"}, {"name": "b", "scale": 0.5}, [{"name": "a"}, {"path": "/b"}]]
    keys = {build_request_batch_sampling_params_key(req(str(i), lora=lora)) for i, lora in enumerate(loras)}
    assert len(keys) == 1


def test_dlo_waves_are_formed_by_lora_adapters():
    """Under DLO the scheduler's key is the wave's (`dlo_wave_key`): the adapters, in any order, are part of it,
    so a wave never mixes adapter sets (the executor would refuse it whole) and each set gets its own wave."""
    a, b = {"name": "a", "path": "/a"}, {"name": "b", "path": "/b", "scale": 0.5}
    sched = request_scheduler(data_parallel_size=2, enable_distributed_layerwise_offload=True,
                              request_batch_max_wait_ms=100)
    sched.add(req("a0", lora=[a, b]), now=0.0)
    sched.add(req("none0"), now=0.1)
    sched.add(req("a1", lora=[b, a]), now=0.2)
    sched.add(req("none1"), now=0.3)
    sched.add(req("b0", lora={**b, "scale": 1.0}), now=0.45)  # b at another scale: another adapter set
    assert ids(next_batch(sched, now=0.5)[0]) == ["a0", "a1"]
    assert ids(next_batch(sched, now=0.5)[0]) == ["none0", "none1"]
    assert next_batch(sched, now=0.5) == ([], pytest.approx(0.05))  # b0 alone waits for company ...
    assert ids(next_batch(sched, now=0.6)[0]) == ["b0"]  # ... at most its max wait (rank 1 then runs a copy)
    plain = request_scheduler(max_num_seqs=2)
    for job in ("a0", "none0"):
        plain.add(req(job, lora=[a, b] if job == "a0" else None), now=0.0)
    assert ids(next_batch(plain, now=0.0)[0]) == ["a0", "none0"]  # rows mix in one forward


@pytest.mark.parametrize(
    "a, b",
    [
        ({"height": 64}, {"height": 128}),
        ({"num_inference_steps": 4}, {"num_inference_steps": 8}),
        ({"true_cfg_scale": 4.0}, {"true_cfg_scale": 1.0}),
        ({"quality": "high"}, {"quality": "lossless"}),
        ({}, {"quality": "lossless"}),
        ({"negative_prompt": "blurry"}, {}),
        ({"extra_args": {"task": "t2v"}}, {"extra_args": {"task": "i2v"}}),
    ],
)
def test_incompatible_params_have_different_keys(a, b):
    assert build_request_batch_sampling_params_key(req("a", **a)) != build_request_batch_sampling_params_key(
        req("b", **b)
    )


def test_full_batch_is_dispatched_without_waiting():
    sched = request_scheduler(max_num_seqs=2, request_batch_max_wait_ms=1000)
    for i in range(3):
        sched.add(req(f"r{i}", seed=i), now=0.0)
    batch, wait = next_batch(sched, now=0.0)
    assert ids(batch) == ["r0", "r1"] and wait is None
    assert sched.num_waiting == 1


def test_partial_batch_waits_at_most_max_wait():
    sched = request_scheduler(max_num_seqs=4, request_batch_max_wait_ms=100)
    sched.add(req("r0"), now=10.0)
    batch, wait = next_batch(sched, now=10.03)
    assert batch == [] and wait == pytest.approx(0.07)
    sched.add(req("r1"), now=10.05)
    batch, _ = next_batch(sched, now=10.1)
    assert ids(batch) == ["r0", "r1"]


def test_zero_wait_dispatches_immediately():
    sched = request_scheduler(max_num_seqs=8)
    sched.add(req("r0"), now=0.0)
    assert ids(next_batch(sched, now=0.0)[0]) == ["r0"]


def test_oldest_request_picks_the_key_and_others_keep_order():
    sched = request_scheduler(max_num_seqs=4)
    sched.add(req("big0", height=128), now=0.0)
    sched.add(req("small0", height=64), now=0.1)
    sched.add(req("big1", height=128), now=0.2)
    sched.add(req("small1", height=64), now=0.3)
    assert ids(next_batch(sched, now=1.0)[0]) == ["big0", "big1"]
    assert ids(next_batch(sched, now=1.0)[0]) == ["small0", "small1"]
    assert next_batch(sched, now=1.0) == ([], None)


def test_abort_and_duplicates():
    sched = request_scheduler(max_num_seqs=4)
    sched.add(req("r0"), now=0.0)
    sched.add(req("r1"), now=0.0)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(req("r0"), now=0.0)
    assert [job.request_id for job in sched.abort(["r0", "unknown"])] == ["r0"]
    assert ids(next_batch(sched, now=0.0)[0]) == ["r1"]


def test_request_mode_slo_prices_requests_by_the_measured_batches():
    """slo's deadlines and cost model work in request mode too: a batch's denoise seconds teach the step cost,
    so a short request without a deadline overtakes a long one that arrived first."""
    sched = request_scheduler(max_num_seqs=1, diffusion_scheduler_policy="slo", slo_deadline_factor=2.0)
    sched.add(req("warm", height=64, width=64, num_inference_steps=10), now=0.0)
    plan = sched.schedule(now=0.0)
    done = DiffusionOutput(stage_durations={"text_encoder": 0.0, "denoise": 1.0, "vae_decode": 0.0})
    ((job, out),) = sched.update(plan, StepResult(plan.round_id, 0, outputs={"warm": done}))
    assert sched.policy.cost.measured(shape_key(job.request), 1) == pytest.approx(0.1)
    assert out.step_stats.step_seconds == [pytest.approx(0.1)] * 10
    sched.add(req("long", height=64, width=64, num_inference_steps=100), now=1.0)  # due at 1 + 2 x 10 s
    sched.add(req("short", height=64, width=64, num_inference_steps=5), now=1.1)  # due at 1.1 + 2 x 0.5 s
    assert ids(next_batch(sched, now=1.2)[0]) == ["short"]
