"""What step-boundary scheduling can buy at best: the step policies replayed on a fake clock.

Replays seeded Poisson arrivals of a mix of (size, steps) classes, deadline = 2x solo, with the real
`StepPolicy` deciding every round and a step costing a fixed number of seconds per size (from a measured run),
co-running k states costing k solo steps (compute-bound: no co-batching gain) unless `--batch-gain` says
otherwise. No encode, decode or HTTP time, no noise: this is the ceiling of reordering, against which a served
run (`diffusion_benchmark_serving.py --compare-modes`) is read. Example (H200 eager step times):

  python benchmarks/diffusion/sim_step_policies.py --mix 512x512:20,512x512:50,1024x1024:20 \\
      --step-seconds 512x512=0.045,1024x1024=0.13 --num-prompts 40 --load 0.8 --seeds 20
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.step_policy import StepPolicy, shape_key
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@dataclass(eq=False)
class Job:
    request: OmniDiffusionRequest
    arrival: float
    deadline: float
    remaining_steps: int


class ShortestRemainingFirst(StepPolicy):
    """Reference ordering (not a served policy): shortest estimated remaining time first, deadlines ignored."""

    def urgency(self, job: Job, now: float) -> tuple:
        return self.remaining_seconds(job), job.arrival


def plan(args: argparse.Namespace, seed: int) -> list[Job]:
    mix = [(size, int(steps)) for size, steps in (item.split(":") for item in args.mix.split(","))]
    solo = [steps * args.step_seconds[size] for size, steps in mix]
    rng, now, jobs = random.Random(seed), 0.0, []
    for i in range(args.num_prompts):
        now += rng.expovariate(args.load / float(np.mean(solo)))
        cls = rng.randrange(len(mix))
        width, height = map(int, mix[cls][0].split("x"))
        sp = OmniDiffusionSamplingParams(width=width, height=height, num_inference_steps=mix[cls][1])
        jobs.append(Job(OmniDiffusionRequest("p", sp, f"r{i}"), now, now + 2 * solo[cls], mix[cls][1]))
    return jobs


def simulate(policy: StepPolicy, jobs: list[Job], args: argparse.Namespace, slots: int) -> list[tuple[float, bool]]:
    """(latency, deadline made) per job."""
    now, pending, held, running, done = 0.0, list(jobs), [], [], []
    while pending or held or running:
        arrived = [j for j in pending if j.arrival <= now]
        if not (arrived or held or running):
            now = pending[0].arrival
            continue
        chosen = policy.choose(running, held, arrived, slots, args.max_paused, now)
        pending = [j for j in pending if j not in chosen]
        held, running = [j for j in held + running if j not in chosen], chosen
        for key in {shape_key(j.request) for j in chosen}:
            count = sum(shape_key(j.request) == key for j in chosen)
            size = f"{key[0]}x{key[1]}"
            seconds = args.step_seconds[size] * (1 + (count - 1) * args.batch_gain.get(size, 1.0))
            policy.cost.observe(key, seconds, batch=count)
            now += seconds
        for j in chosen:
            j.remaining_steps -= 1
            if not j.remaining_steps:
                done.append((now - j.arrival, now <= j.deadline))
        running = [j for j in running if j.remaining_steps]
    return done


def per_size(text: str) -> dict[str, float]:
    """"512x512=0.045,1024x1024=0.13" -> {"512x512": 0.045, "1024x1024": 0.13}."""
    return {size: float(value) for size, value in (item.split("=") for item in text.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mix", default="512x512:20,512x512:50,1024x1024:20")
    parser.add_argument("--step-seconds", default="512x512=0.045,1024x1024=0.13", type=per_size)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--slots", type=int, default=4, help="--max-num-seqs of the step modes")
    parser.add_argument("--max-paused", type=int, default=4)
    parser.add_argument("--batch-gain", type=per_size, default={},
                        help="SIZE=x,...: cost of each extra co-run state / a solo step (default 1 = compute-bound)")
    args = parser.parse_args()
    modes = {"request-fcfs": (lambda: StepPolicy("fcfs"), 1), "step-fcfs": (lambda: StepPolicy("fcfs"), args.slots),
             "step-slo": (lambda: StepPolicy("slo"), args.slots),
             "shortest-remaining-first": (lambda: ShortestRemainingFirst("slo"), 1)}
    rows = {}
    for mode, (make, slots) in modes.items():
        runs = [simulate(make(), plan(args, seed), args, slots) for seed in range(args.seeds)]
        rows[mode] = [np.mean([np.mean([lat for lat, _ in r]) for r in runs]),
                      np.mean([np.percentile([lat for lat, _ in r], 95) for r in runs]),
                      np.mean([np.mean([made for _, made in r]) for r in runs])]
    base = rows["request-fcfs"]
    print(f"{'mode':<26}{'mean s':>8}{'p95 s':>8}{'attain':>8}{'mean/req':>10}{'p95/req':>9}")
    for mode, (mean, p95, made) in rows.items():
        print(f"{mode:<26}{mean:>8.2f}{p95:>8.2f}{made:>8.0%}{mean / base[0]:>10.2f}{p95 / base[1]:>9.2f}")


if __name__ == "__main__":
    main()
