"""What step-boundary scheduling can buy: the step policies replayed on a fake clock, over many seeds.

Replays seeded Poisson arrivals of a mix of (size, steps) classes, deadline = 2x solo, with the real
`StepPolicy` (or a candidate ordering below) deciding every round, as the `DiffusionScheduler` runs it: a job is encoded
when first admitted, every chosen job takes one step, a finished job is decoded, all on one clock. A step costs
fixed seconds per size; k co-run states of a size cost (1 + (k - 1) x gain) solo steps, the gain derived from
a measured per-request speed-up at batch 8 (`--batch-speedup`). Request FCFS = one request at a time, encode
to decode. No HTTP or noise: the ceiling of reordering, against which a served run
(`diffusion_benchmark_serving.py --compare-modes`) is read. Defaults = issue 14's H200 setting (Qwen-Image real
size, eager, from the served run `diffusion_serving_modes-h200-20261201T181141Z.json` and the pipeline stage
durations in docs/benchmarks.md):

  python benchmarks/diffusion/sim_step_policies.py --seeds 200

Every ratio is per seed against request FCFS on the same arrivals, then mean +- standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_omni.diffusion.core.policy import AdmissionControl, StepPolicy, shape_key
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

TARGETS = {"mean": 0.7, "p95": 0.8, "attain": 0.9, "thr": 0.98}
"""Issue 14: step SLO mean <= 0.7x and p95 <= 0.8x request FCFS, attainment >= 90%, throughput >= 0.98x."""


@dataclass(eq=False)
class Job:
    request: OmniDiffusionRequest
    arrival: float
    deadline: float
    remaining_steps: int
    prepared: bool = False


class ShortestRemainingFirst(StepPolicy):
    """Reference ordering (not served): shortest estimated remaining time first, deadlines ignored."""

    def urgency(self, job: Job, now: float) -> tuple:
        return self.remaining_seconds(job), job.arrival


class FeasibleShortestRemaining(StepPolicy):
    """Candidate: the slo tiers (starved first, then feasible, then hopeless), least remaining cost first in each."""

    def urgency(self, job: Job, now: float) -> tuple:
        return self.slo_tier(job, now), self.remaining_seconds(job), job.arrival


class LeastLaxity(StepPolicy):
    """Candidate: the slo tiers, least laxity (deadline - now - remaining cost) first in each."""

    def urgency(self, job: Job, now: float) -> tuple:
        return self.slo_tier(job, now), job.deadline - now - self.remaining_seconds(job), job.arrival


class MooreHodgson(StepPolicy):
    """Candidate: the slo tiers and EDF, but a feasible job is demoted to hopeless while the EDF order of the
    jobs at hand (starved first) has one finishing late: the one with the most remaining cost among those up to
    it (Moore-Hodgson: the most deadlines met of the jobs at hand)."""

    demoted: frozenset[int] = frozenset()

    def choose(self, running: list, paused: list, waiting: list, slots: int, max_paused: int, now: float) -> list:
        self.demoted = self._demote(running + paused + waiting, now)
        return super().choose(running, paused, waiting, slots, max_paused, now)

    def urgency(self, job: Job, now: float) -> tuple:
        tier = self.slo_tier(job, now)
        return 2 if tier == 1 and id(job) in self.demoted else tier, job.deadline, job.arrival

    def _demote(self, jobs: list[Job], now: float) -> frozenset[int]:
        tiers = {id(j): self.slo_tier(j, now) for j in jobs}
        t = now + sum(self.remaining_seconds(j) for j in jobs if tiers[id(j)] == 0)
        kept, demoted = [], set()
        for j in sorted((j for j in jobs if tiers[id(j)] == 1), key=lambda j: j.deadline):
            kept.append(j)
            t += self.remaining_seconds(j)
            if t > j.deadline:
                longest = max(kept, key=self.remaining_seconds)
                kept.remove(longest)
                t -= self.remaining_seconds(longest)
                demoted.add(id(longest))
        return frozenset(demoted)


def plan(args: argparse.Namespace, seed: int) -> list[Job]:
    mix = [(size, int(steps)) for size, steps in (item.split(":") for item in args.mix.split(","))]
    solo = [solo_seconds(args, size, steps) for size, steps in mix]
    rng, now, jobs = random.Random(seed), 0.0, []
    for i in range(args.num_prompts):
        now += rng.expovariate(args.load / float(np.mean(solo)))
        cls = rng.randrange(len(mix))
        width, height = map(int, mix[cls][0].split("x"))
        sp = OmniDiffusionSamplingParams(width=width, height=height, num_inference_steps=mix[cls][1])
        jobs.append(Job(OmniDiffusionRequest("p", sp, f"r{i}"), now, now + 2 * solo[cls], mix[cls][1]))
    return jobs


def solo_seconds(args: argparse.Namespace, size: str, steps: int) -> float:
    return args.encode_seconds.get(size, 0.0) + steps * args.step_seconds[size] + args.decode_seconds.get(size, 0.0)


def simulate(policy: StepPolicy, jobs: list[Job], args: argparse.Namespace, slots: int,
             min_accept: float | None = None) -> tuple[list[tuple[float, bool, float]], int, float]:
    """((latency, deadline made, latency / deadline window) per finished job, rejected count, finish time of the
    last job). `min_accept`: admission control with that floor, as the served `--slo-admission-control` (None:
    off; 0: no floor)."""
    now, pending, held, running, done, rejected = 0.0, list(jobs), [], [], [], 0
    waiting: list[Job] = []
    admission = None if min_accept is None else AdmissionControl(min_accept)
    while pending or waiting or held or running:
        arrived, pending = [j for j in pending if j.arrival <= now], [j for j in pending if j.arrival > now]
        for j in arrived:
            if admission is not None and admission.refuse(policy, waiting + held + running, j, now) is not None:
                rejected += 1
            else:
                waiting.append(j)
        if not (waiting or held or running):
            now = pending[0].arrival
            continue
        chosen = policy.choose(running, held, waiting, slots, args.max_paused, now)
        waiting = [j for j in waiting if j not in chosen]
        held, running = [j for j in held + running if j not in chosen], chosen
        now = run_round(policy, chosen, args, now, done)
        running = [j for j in running if j.remaining_steps]
    return done, rejected, now


def run_round(policy: StepPolicy, chosen: list[Job], args: argparse.Namespace, now: float,
              done: list[tuple[float, bool, float]]) -> float:
    """Encode the newly admitted, one step for every chosen job, decode the finished; the clock after it."""
    for j in chosen:
        if not j.prepared:
            encode = args.encode_seconds.get(size_of(j), 0.0)
            now += encode
            j.prepared = True
            if args.cost_model_phases:
                policy.cost.observe_phase(shape_key(j.request), "encode", encode)
    for key in {shape_key(j.request) for j in chosen}:
        count = sum(shape_key(j.request) == key for j in chosen)
        size = f"{key[0]}x{key[1]}"
        seconds = args.step_seconds[size] * (1 + (count - 1) * batch_gain(args, size))
        policy.cost.observe(key, seconds, batch=count)
        now += seconds
    for j in chosen:
        j.remaining_steps -= 1
        if not j.remaining_steps:
            decode = args.decode_seconds.get(size_of(j), 0.0)
            now += decode
            if args.cost_model_phases:
                policy.cost.observe_phase(shape_key(j.request), "decode", decode)
            done.append((now - j.arrival, now <= j.deadline, (now - j.arrival) / (j.deadline - j.arrival)))
    return now


def size_of(job: Job) -> str:
    return f"{job.request.sampling_params.width}x{job.request.sampling_params.height}"


def batch_gain(args: argparse.Namespace, size: str) -> float:
    """Cost of each extra co-run state / a solo step, from the per-request speed-up at batch 8."""
    return (8 / args.batch_speedup.get(size, 1.0) - 1) / 7


def modes(args: argparse.Namespace) -> dict[str, tuple[Callable[[], StepPolicy], int, float | None]]:
    """name -> (policy factory, slots, admission control's floor or None)."""
    s = args.slots
    rows = {"request-fcfs": (lambda: StepPolicy("fcfs"), 1, None),
            "step-fcfs": (lambda: StepPolicy("fcfs"), s, None),
            "slo, no starvation bound": (lambda: StepPolicy("slo", starvation_factor=math.inf), s, None)}
    candidates = (("slo", StepPolicy), ("feasible-SRPT", FeasibleShortestRemaining),
                  ("EDF + Moore-Hodgson", MooreHodgson), ("least-laxity", LeastLaxity))
    for x in args.starvation_factors:
        for label, cls in candidates:
            rows[f"{label}, starvation {x:g}"] = (lambda cls=cls, x=x: cls("slo", starvation_factor=x), s, None)
    rows["EDF + admission control"] = (lambda: StepPolicy("slo", starvation_factor=math.inf), s, 0.0)
    for floor in args.admission_floors:
        rows[f"slo + admission control, floor {floor:g}"] = (
            lambda: StepPolicy("slo", starvation_factor=args.starvation_factors[-1]), s, floor)
    rows["SRPT (reference)"] = (lambda: ShortestRemainingFirst("slo"), 1, None)
    return {name: row for name, row in rows.items() if name == "request-fcfs" or re.search(args.only, name)}


def metrics(jobs: int, result: tuple[list[tuple[float, bool, float]], int, float],
            first_arrival: float) -> np.ndarray:
    """mean s, p95 s, attainment (rejected = missed), throughput (finished / s from the first arrival), worst
    latency / deadline window."""
    done, _, end = result
    lat = [lat for lat, _, _ in done]
    return np.array([np.mean(lat), np.percentile(lat, 95), sum(m for _, m, _ in done) / jobs,
                     len(done) / (end - first_arrival), max(w for _, _, w in done)])


def table(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """name -> per-seed rows: `metrics`, then the same / request FCFS's."""
    per_seed: dict[str, list[np.ndarray]] = {}
    for seed in range(args.seeds):
        base = None
        for name, (make, slots, admission) in modes(args).items():
            jobs = plan(args, seed)
            m = metrics(len(jobs), simulate(make(), jobs, args, slots, admission), jobs[0].arrival)
            base = m if base is None else base
            per_seed.setdefault(name, []).append(np.concatenate([m, m / base]))
    return {name: np.array(rows) for name, rows in per_seed.items()}


def print_table(rows: dict[str, np.ndarray]) -> None:
    print("| policy | mean / req-FCFS | p95 / req-FCFS | attainment | throughput / req-FCFS | worst latency / "
          "deadline window | targets met (mean, p95, attainment, throughput) | share of seeds all met |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        mean, p95, attain, thr, worst = (r[:, i] for i in (5, 6, 2, 8, 4))
        met = [mean.mean() <= TARGETS["mean"], p95.mean() <= TARGETS["p95"], attain.mean() >= TARGETS["attain"],
               thr.mean() >= TARGETS["thr"]]
        every = np.mean((mean <= TARGETS["mean"]) & (p95 <= TARGETS["p95"]) & (attain >= TARGETS["attain"])
                        & (thr >= TARGETS["thr"]))
        cells = [f"{mean.mean():.2f} ± {mean.std():.2f}", f"{p95.mean():.2f} ± {p95.std():.2f}",
                 f"{attain.mean():.0%} ± {attain.std():.0%}", f"{thr.mean():.3f} ± {thr.std():.3f}",
                 f"{worst.mean():.1f} (max {worst.max():.1f})", "".join("y" if m else "n" for m in met),
                 f"{every:.0%}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def per_size(text: str) -> dict[str, float]:
    """"512x512=0.045,1024x1024=0.13" -> {"512x512": 0.045, "1024x1024": 0.13}."""
    return {size: float(value) for size, value in (item.split("=") for item in text.split(",") if item)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mix", default="512x512:20,512x512:50,1024x1024:20,1024x1024:50")
    parser.add_argument("--step-seconds", default="512x512=0.0527,1024x1024=0.1328", type=per_size,
                        help="SIZE=s,...: one solo step (H200 eager, served run (a))")
    parser.add_argument("--encode-seconds", default="512x512=0.015,1024x1024=0.015", type=per_size)
    parser.add_argument("--decode-seconds", default="512x512=0.012,1024x1024=0.10", type=per_size)
    parser.add_argument("--batch-speedup", default="512x512=1.11,1024x1024=1.05", type=per_size,
                        help="SIZE=x,...: per-request speed-up of batch 8 over batch 1 (1 = compute-bound)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--slots", type=int, default=4, help="--max-num-seqs of the step modes")
    parser.add_argument("--max-paused", type=int, default=4)
    parser.add_argument("--starvation-factors", default="0,0.5,1,2", type=lambda t: [float(x) for x in t.split(",")],
                        help="--slo-starvation-factor values to try")
    parser.add_argument("--admission-floors", default="0.9", type=lambda t: [float(x) for x in t.split(",")],
                        help="--slo-admission-min-accept values to try (slo at the last starvation factor)")
    parser.add_argument("--only", default="", help="regex: simulate only the policies it matches (+ request-fcfs)")
    parser.add_argument("--no-cost-model-phases", dest="cost_model_phases", action="store_false",
                        help="the policy's cost model ignores encode / decode (steps only)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON of the table: the command and each policy's per-seed rows (the printed columns)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, np.ndarray]:
    args = parse_args(argv)
    rows = table(args)
    print_table(rows)
    if args.out:
        report = {"command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
                  "rows": {name: r.tolist() for name, r in rows.items()}}
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
