"""Prometheus series of diffusion stages, fed by each finished request's output: the scheduler's `StepStats`
(either mode; the core's scheduler -> `DiffusionOutput.step_stats` -> `OmniRequestOutput.step_stats`) and the
compiled path's `CompileStats` (either mode).

The gauges (requests waiting / running, memory reserved / budget per stage) are the scheduler's at the moment the
latest request left, so they move whenever a request finishes (an idle server shows 0 once its last request is
done). The compile and capture counters rise by what
the worker's cumulative counts grew since the last output of that stage: the start-up warm-up's counts
(`phase="warmup"`) show with the first finished request, and any serving-time compile or capture (a stall of
its batch, also logged as a WARNING) under `phase="serving"`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_omni.outputs import CompileStats, StepStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DiffusionStepMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.waiting = Gauge("vllm_omni:diffusion_requests_waiting",
                             "Diffusion requests waiting for a step slot (queued or paused).", ["model_name"],
                             registry=registry)
        self.running = Gauge("vllm_omni:diffusion_requests_running",
                             "Resident diffusion states taking denoise steps.", ["model_name"], registry=registry)
        self.memory_reserved = Gauge("vllm_omni:diffusion_memory_reserved_bytes",
                                     "Bytes memory admission holds for the requests on a diffusion stage's workers.",
                                     ["model_name", "stage"], registry=registry)
        self.memory_budget = Gauge("vllm_omni:diffusion_memory_budget_bytes",
                                   "A diffusion stage's memory admission budget (free device memory after load, or "
                                   "--diffusion-memory-budget-gb).", ["model_name", "stage"], registry=registry)
        self.step_time = Histogram("vllm_omni:diffusion_step_seconds",
                                   "Seconds per denoise step, by shape and by the states that shared its forward.",
                                   ["model_name", "shape", "batch"], buckets=_STEP_BUCKETS, registry=registry)
        self.preemptions = Counter("vllm_omni:diffusion_preemptions",
                                   "Resident diffusion states paused at a step boundary for a more urgent request.",
                                   ["model_name"], registry=registry)
        self.deadline_misses = Counter("vllm_omni:diffusion_deadline_misses",
                                       "Diffusion requests finished after their deadline.", ["model_name"],
                                       registry=registry)
        self.compiles = Counter("vllm_omni:diffusion_graph_compiles",
                                "Graphs Dynamo compiled on the compiled path (warmup: before ready; serving: a "
                                "stall of the requests in its forward).", ["model_name", "phase"],
                                registry=registry)
        self.captures = Counter("vllm_omni:diffusion_cuda_graph_captures",
                                "CUDA graphs captured on the compiled path (warmup: before ready; serving: a "
                                "stall of the requests in its forward).", ["model_name", "phase"],
                                registry=registry)
        self.preemptions.labels(model_name)  # exported as 0 before the first event
        self.deadline_misses.labels(model_name)
        for phase in ("warmup", "serving"):
            self.compiles.labels(model_name, phase)
            self.captures.labels(model_name, phase)
        self._compile_seen: dict[int, CompileStats] = {}
        """Per stage id: the counts of its latest output (the worker's are cumulative)."""

    def observe(self, stats: StepStats | None, stage_id: int = 0) -> None:
        if stats is None:
            return
        name = self.model_name
        self.waiting.labels(name).set(stats.waiting)
        self.running.labels(name).set(stats.running)
        if stats.budget_bytes is not None:
            self.memory_reserved.labels(name, str(stage_id)).set(stats.reserved_bytes)
            self.memory_budget.labels(name, str(stage_id)).set(stats.budget_bytes)
        batches = stats.step_batches or [1] * len(stats.step_seconds)
        for seconds, batch in zip(stats.step_seconds, batches, strict=True):
            self.step_time.labels(name, stats.shape, str(batch)).observe(seconds)
        self.preemptions.labels(name).inc(stats.preemptions)
        self.deadline_misses.labels(name).inc(int(stats.deadline_missed))

    def observe_compiles(self, stage_id: int, stats: CompileStats | None) -> None:
        """Raise the counters by what the stage's worker counted since its previous output (a restarted worker
        counts from 0 again: its counts are then new)."""
        if stats is None:
            return
        seen = self._compile_seen.get(stage_id, CompileStats())
        if stats.compiles < seen.compiles or stats.captures < seen.captures:
            seen = CompileStats()
        self._compile_seen[stage_id] = stats
        name = self.model_name
        for counter, total, serving, total_seen, serving_seen in (
            (self.compiles, stats.compiles, stats.serving_compiles, seen.compiles, seen.serving_compiles),
            (self.captures, stats.captures, stats.serving_captures, seen.captures, seen.serving_captures),
        ):
            counter.labels(name, "serving").inc(serving - serving_seen)
            counter.labels(name, "warmup").inc((total - serving) - (total_seen - serving_seen))
