"""The slo step policy's decisions, with a fake clock and fake step costs (pure Python, no pipeline).

Pins: slo runs the most urgent job alone unless co-batching its shape pays (unmeasured: tried once after the
solo step is measured; measured: batched round <= COBATCH_GAIN x the solo steps, and no job that could make its
deadline misses it at the batched pace); a more urgent arrival takes the round at the next boundary; admission
respects `max_paused`; on a mix of sizes with deadline = 2x solo, slo's mean latency is well below
run-to-completion FCFS while the work done is the same; a hopeless job waits behind feasible work only until its
starvation bound, and feasible jobs meet their deadlines in an overload that ends before it; the remaining cost
includes the measured encode (before admission) and decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from vllm_omni.diffusion.core.policy import COBATCH_GAIN, StepCostModel, StepPolicy, shape_key
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP


@dataclass(eq=False)
class Job:
    request: OmniDiffusionRequest
    arrival: float
    deadline: float
    remaining_steps: int
    prepared: bool = False


def job(rid: str, size: int, steps: int, arrival: float = 0.0, deadline: float = 100.0) -> Job:
    return Job(OmniDiffusionRequest("p", SP(width=size, height=size, num_inference_steps=steps), rid), arrival,
               deadline, steps)


def key(size: int):
    return shape_key(OmniDiffusionRequest("p", SP(width=size, height=size), "k"))


def ids(jobs: list[Job]) -> list[str]:
    return [j.request.request_id for j in jobs]


def slo(costs: dict[tuple[int, int], float] | None = None, starvation_factor: float = math.inf) -> StepPolicy:
    """(size, batch) -> seconds of one round of `batch` states of that size."""
    policy = StepPolicy("slo", starvation_factor=starvation_factor)
    for (size, batch), seconds in (costs or {}).items():
        policy.cost.observe(key(size), seconds, batch=batch)
    return policy


def test_nothing_to_run():
    assert slo().choose([], [], [], slots=4, max_paused=4, now=0.0) == []


def test_different_shapes_do_not_share_rounds():
    policy = slo({(64, 1): 1.0, (32, 1): 0.25})
    big, small = job("big", 64, 10, deadline=50.0), job("small", 32, 10, deadline=20.0)
    assert ids(policy.choose([big], [], [small], slots=4, max_paused=4, now=0.0)) == ["small"]


def test_cobatching_is_tried_once_then_kept_only_where_it_pays():
    a, b, c = (job(n, 32, 10, deadline=100.0 + i) for i, n in enumerate("abc"))
    assert ids(slo().choose([a], [], [b, c], 4, 4, 0.0)) == ["a"]  # the solo step is measured first
    assert ids(slo({(32, 1): 1.0}).choose([a], [], [b, c], 4, 4, 0.0)) == ["a", "b", "c"]  # unmeasured: try
    pays = slo({(32, 1): 1.0, (32, 2): 1.2, (32, 3): 1.5})
    assert ids(pays.choose([a, b, c], [], [], 4, 4, 0.0)) == ["a", "b", "c"]
    compute_bound = slo({(32, 1): 1.0, (32, 2): 2.0 * COBATCH_GAIN + 0.1})
    assert ids(compute_bound.choose([a, b], [], [c], 4, 4, 0.0)) == ["a"]


def test_cobatching_never_makes_a_job_miss_a_deadline_it_could_make_alone():
    policy = slo({(32, 1): 1.0, (32, 2): 1.5})
    tight, relaxed = job("tight", 32, 10, deadline=12.0), job("relaxed", 32, 10, deadline=40.0)
    assert ids(policy.choose([tight], [], [relaxed], 4, 4, 0.0)) == ["tight"]  # 10 x 1.5 s > 12 s
    assert ids(policy.choose([tight], [], [relaxed], 4, 4, -10.0)) == ["tight", "relaxed"]


def test_a_more_urgent_arrival_takes_the_round_and_a_hopeless_one_goes_last():
    policy = slo({(64, 1): 1.0})
    running = job("running", 64, 20, deadline=60.0)
    urgent = job("urgent", 64, 2, arrival=5.0, deadline=10.0)
    hopeless = job("hopeless", 64, 20, arrival=5.0, deadline=6.0)
    assert ids(policy.choose([running], [], [hopeless, urgent], 1, 4, 5.0)) == ["urgent"]
    assert ids(policy.choose([], [running], [hopeless], 1, 4, 7.0)) == ["running"]


def test_admission_keeps_paused_states_within_max_paused():
    policy = slo({(64, 1): 1.0, (64, 2): 2.0, (32, 1): 0.1})
    held = [job(f"held{i}", 64, 10, deadline=50.0 + i) for i in range(3)]
    newcomer = job("new", 32, 10, deadline=5.0)
    assert ids(policy.choose(held[:1], held[1:], [newcomer], 4, 3, 0.0)) == ["new"]  # all 3 may stay paused
    assert ids(policy.choose(held[:1], held[1:], [newcomer], 4, 2, 0.0)) == ["held0"]  # new waits
    assert ids(policy.choose(held[:1], held[1:], [newcomer], 4, 1, 0.0)) == ["held0", "held1"]  # 1 paused at most


def test_batched_costs_are_learned_per_batch_size():
    cost = StepCostModel(alpha=0.5)
    cost.observe(key(32), 1.0)
    cost.observe(key(32), 1.6, batch=2)
    assert cost.step_seconds(key(32), 2) == pytest.approx(1.6)
    assert cost.step_seconds(key(32), 3) == pytest.approx(3.0)  # unmeasured batch: no gain assumed
    assert cost.measured(key(32), 3) is None


def simulate(policy: StepPolicy, jobs: list[Job], step_cost: dict[int, float], slots: int) -> dict[str, float]:
    """Rounds on a fake clock: each round the policy picks, each picked job takes one step, a round costs the solo
    steps of what it ran (compute-bound: co-running buys nothing); returns each job's latency."""
    now, pending, held, done = 0.0, sorted(jobs, key=lambda j: j.arrival), [], {}
    running: list[Job] = []
    while pending or held or running:
        arrived = [j for j in pending if j.arrival <= now]
        if not (arrived or held or running):
            now = pending[0].arrival
            continue
        chosen = policy.choose(running, held, arrived, slots, 4, now)
        pending = [j for j in pending if j not in chosen]
        held = [j for j in held + running if j not in chosen]
        running = chosen
        for size in {j.request.sampling_params.width for j in chosen}:
            count = sum(j.request.sampling_params.width == size for j in chosen)
            now += step_cost[size] * count
            policy.cost.observe(key(size), step_cost[size] * count, batch=count)
        for j in chosen:
            j.remaining_steps -= 1
            if not j.remaining_steps:
                done[j.request.request_id] = now - j.arrival
        running = [j for j in running if j.remaining_steps]
    return done


@pytest.mark.parametrize("slots", [1, 4])
def test_on_a_mix_of_sizes_slo_beats_run_to_completion_fcfs(slots):
    step_cost = {64: 1.0, 32: 0.25}
    solo = {64: 20 * 1.0, 32: 8 * 0.25}

    def mix() -> list[Job]:
        shapes = [(64, 20), (32, 8), (32, 8), (64, 20), (32, 8), (32, 8), (64, 20), (32, 8)]
        return [job(f"r{i}", size, steps, arrival=2.5 * i, deadline=2.5 * i + 2 * solo[size])
                for i, (size, steps) in enumerate(shapes)]

    fcfs = simulate(StepPolicy("fcfs"), mix(), step_cost, slots=1)  # request mode: one request to the end
    ours = simulate(slo(), mix(), step_cost, slots=slots)
    assert sum(ours.values()) <= 0.7 * sum(fcfs.values())
    smalls = [f"r{i}" for i in (1, 2, 4, 5, 7)]
    assert max(ours[r] for r in smalls) <= 2 * solo[32] < max(fcfs[r] for r in smalls)


def stream(n: int, period: float, start: float = 0.0) -> list[Job]:
    """Short jobs (64^2 x 2 steps of 1 s, deadline 2x solo) arriving every `period` s: load 2 / period."""
    return [job(f"s{i}", 64, 2, arrival=start + period * i, deadline=start + period * i + 4.0) for i in range(n)]


@pytest.mark.parametrize("factor", [0.0, 1.0, 3.0])
def test_a_hopeless_job_runs_within_its_starvation_bound_under_sustained_load(factor):
    hopeless = job("hopeless", 64, 10, deadline=5.0)  # 10 s of work, 5 s window: hopeless once measured
    done = simulate(slo({(64, 1): 1.0}, starvation_factor=factor), [hopeless, *stream(50, 2.0)], {64: 1.0}, 1)
    bound = (1 + factor) * 5.0  # late by factor x its window: it runs before the feasible ones from then on
    assert bound < done["hopeless"] <= bound + 1.0 + 10.0  # + the round in flight + its own 10 steps
    unbounded = simulate(slo({(64, 1): 1.0}), [job("hopeless", 64, 10, deadline=5.0), *stream(50, 2.0)], {64: 1.0}, 1)
    assert unbounded["hopeless"] > 100.0  # no bound: it waits for the whole 100 s stream


def test_feasible_jobs_meet_their_deadlines_in_an_overload_shorter_than_the_bound():
    hopeless = [job(f"h{i}", 64, 10, deadline=5.0) for i in range(2)]  # 20 s of work that cannot make 5 s
    shorts = stream(10, 2.0)  # 20 s at load 1 on top of it: overloaded until t = 20
    done = simulate(slo({(64, 1): 1.0}, starvation_factor=4.0), [*hopeless, *shorts], {64: 1.0}, 1)
    assert all(done[j.request.request_id] <= 4.0 for j in shorts)  # every feasible one in time
    assert max(done["h0"], done["h1"]) <= 20.0 + 20.0  # the hopeless ones right after the overload
    fcfs = simulate(StepPolicy("fcfs"), [*(job(f"h{i}", 64, 10, deadline=5.0) for i in range(2)), *stream(10, 2.0)],
                    {64: 1.0}, 1)
    assert sum(fcfs[j.request.request_id] > 4.0 for j in shorts) == len(shorts)  # FCFS: all of them late


def test_tiers_order_starved_then_feasible_then_hopeless():
    policy = slo({(64, 1): 1.0}, starvation_factor=1.0)
    feasible, hopeless = job("feasible", 64, 2, deadline=10.0), job("hopeless", 64, 10, deadline=5.0)
    assert [policy.slo_tier(j, 0.0) for j in (feasible, hopeless)] == [1, 2]
    assert policy.slo_tier(hopeless, 10.0) == 2 and policy.slo_tier(hopeless, 10.1) == 0  # 5 + 1 x 5 s
    assert ids(policy.choose([], [], [feasible, hopeless], 1, 4, 10.1)) == ["hopeless"]
    with pytest.raises(ValueError, match="slo_starvation_factor"):
        StepPolicy("slo", starvation_factor=-1.0)


def test_remaining_cost_includes_measured_encode_before_admission_and_decode():
    policy = slo({(64, 1): 1.0})
    waiting, resident = job("waiting", 64, 3), job("resident", 64, 3)
    resident.prepared = True
    assert policy.remaining_seconds(waiting) == policy.remaining_seconds(resident) == pytest.approx(3.0)
    policy.cost.observe_phase(key(64), "encode", 0.5)
    policy.cost.observe_phase(key(64), "decode", 2.0)
    assert policy.remaining_seconds(waiting) == pytest.approx(5.5)
    assert policy.remaining_seconds(resident) == pytest.approx(5.0)
    tight = job("tight", 64, 3, deadline=4.0)  # 3 s of steps fit, not with 2 s of decode
    assert not policy.can_make_deadline(tight, 0.0)


def test_a_request_without_deadline_gets_k_times_its_estimated_solo_time():
    """No `deadline_ms`: deadline = k x the cost model's solo estimate (encode + steps x step + decode), so under
    slo a short request that arrives behind a long one is served first; the client's own deadline wins; before
    anything prices the shape, and with k = 0, the default deadline."""
    policy = StepPolicy("slo", default_deadline_ms=60000.0, deadline_factor=2.0)

    def request(size: int, steps: int, deadline_ms: float | None = None) -> OmniDiffusionRequest:
        return OmniDiffusionRequest("p", SP(width=size, height=size, num_inference_steps=steps,
                                            deadline_ms=deadline_ms), f"{size}-{steps}")

    assert policy.deadline_ms(request(64, 20)) == 60000.0  # nothing measured yet
    policy.cost.observe(key(64), 0.1)
    policy.cost.observe_phase(key(64), "encode", 0.05)
    policy.cost.observe_phase(key(64), "decode", 0.15)
    assert policy.deadline_ms(request(64, 20)) == pytest.approx(2.0 * (0.05 + 20 * 0.1 + 0.15) * 1000)
    assert policy.deadline_ms(request(128, 20)) == pytest.approx(2.0 * 20 * 0.4 * 1000)  # priced by pixels
    assert policy.deadline_ms(request(64, 20, deadline_ms=500.0)) == 500.0
    assert StepPolicy("slo", deadline_factor=0.0, default_deadline_ms=9.0).deadline_ms(request(64, 20)) == 9.0

    policy.cost.observe(key(128), 0.4)
    long_job, short_job = (job(f"{size}", size, steps) for size, steps in ((128, 50), (64, 20)))
    for j, arrival in ((long_job, 0.0), (short_job, 1.0)):
        j.arrival, j.deadline = arrival, arrival + policy.deadline_ms(j.request) / 1000
    assert ids(policy.choose([long_job], [], [short_job], slots=4, max_paused=4, now=1.0)) == ["64"]


def test_the_step_scheduler_takes_its_deadlines_from_the_policy():
    from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    scheduler = DiffusionScheduler(OmniDiffusionConfig(model="m", diffusion_scheduler_policy="slo",
                                                  slo_deadline_factor=3.0, default_deadline_ms=7000.0))
    request = OmniDiffusionRequest("p", SP(width=64, height=64, num_inference_steps=10), "r")
    assert scheduler.add(request).deadline_ms == 7000.0
    scheduler.policy.cost.observe(key(64), 0.2)
    request2 = OmniDiffusionRequest("p", SP(width=64, height=64, num_inference_steps=10), "r2")
    assert scheduler.add(request2).deadline_ms == pytest.approx(3.0 * 10 * 0.2 * 1000)
    with pytest.raises(ValueError, match="slo_deadline_factor"):
        OmniDiffusionConfig(model="m", slo_deadline_factor=-1.0)
