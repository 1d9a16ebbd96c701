"""Prometheus series of the diffusion step scheduler (`--step-execution`), fed by each finished request's
`StepStats` (worker -> `DiffusionOutput.step_stats` -> `OmniRequestOutput.step_stats`).

The two gauges are the worker's counts at the moment the latest request left, so they move whenever a request
finishes (an idle server shows 0 once its last request is done).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from vllm_omni.outputs import StepStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DiffusionStepMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.waiting = Gauge("vllm_omni:diffusion_requests_waiting",
                             "Diffusion requests waiting for a step slot (queued or paused).", ["model_name"],
                             registry=registry)
        self.running = Gauge("vllm_omni:diffusion_requests_running",
                             "Resident diffusion states taking denoise steps.", ["model_name"], registry=registry)
        self.step_time = Histogram("vllm_omni:diffusion_step_seconds", "Seconds per denoise step, by shape.",
                                   ["model_name", "shape"], buckets=_STEP_BUCKETS, registry=registry)
        self.preemptions = Counter("vllm_omni:diffusion_preemptions",
                                   "Resident diffusion states paused at a step boundary for a more urgent request.",
                                   ["model_name"], registry=registry)
        self.deadline_misses = Counter("vllm_omni:diffusion_deadline_misses",
                                       "Diffusion requests finished after their deadline.", ["model_name"],
                                       registry=registry)
        self.preemptions.labels(model_name)  # exported as 0 before the first event
        self.deadline_misses.labels(model_name)

    def observe(self, stats: StepStats | None) -> None:
        if stats is None:
            return
        name = self.model_name
        self.waiting.labels(name).set(stats.waiting)
        self.running.labels(name).set(stats.running)
        histogram = self.step_time.labels(name, stats.shape)
        for seconds in stats.step_seconds:
            histogram.observe(seconds)
        self.preemptions.labels(name).inc(stats.preemptions)
        self.deadline_misses.labels(name).inc(int(stats.deadline_missed))
