"""The diffusion Prometheus series: what one finished request's `StepStats` and `CompileStats` add to /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.entrypoints.openai.diffusion_metrics import DiffusionStepMetrics
from vllm_omni.entrypoints.openai.metrics import OmniMetrics
from vllm_omni.outputs import CompileStats, StepStats


def samples(metrics: OmniMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().body.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_step_stats_feed_the_scheduler_series():
    metrics = OmniMetrics("m")
    before = samples(metrics)
    assert before[("vllm_omni:diffusion_preemptions_total", (("model_name", "m"),))] == 0
    metrics.diffusion_steps.observe(None)  # request mode: nothing
    metrics.diffusion_steps.observe(StepStats("64x64+cfg", [0.002, 0.02, 0.3], preemptions=2, deadline_missed=True,
                                              waiting=3, running=1))
    metrics.diffusion_steps.observe(StepStats("64x64+cfg", [0.002], waiting=0, running=0))
    got = samples(metrics)
    model = (("model_name", "m"),)
    shape = (("batch", "1"), ("model_name", "m"), ("shape", "64x64+cfg"))
    assert got[("vllm_omni:diffusion_preemptions_total", model)] == 2
    assert got[("vllm_omni:diffusion_deadline_misses_total", model)] == 1
    assert got[("vllm_omni:diffusion_requests_waiting", model)] == 0  # the latest request's snapshot
    assert got[("vllm_omni:diffusion_requests_running", model)] == 0
    assert got[("vllm_omni:diffusion_step_seconds_count", shape)] == 4
    assert got[("vllm_omni:diffusion_step_seconds_bucket", (shape[0], ("le", "0.0025"), *shape[1:]))] == 2


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_step_time_is_labelled_by_shape_and_batch():
    registry = CollectorRegistry()
    metrics = DiffusionStepMetrics(registry, "m")
    metrics.observe(StepStats("512x512", step_seconds=[0.1, 0.2, 0.3], step_batches=[1, 4, 4], preemptions=1,
                              deadline_missed=True))
    assert _value(registry, "vllm_omni:diffusion_step_seconds_count", shape="512x512", batch="1") == 1
    assert _value(registry, "vllm_omni:diffusion_step_seconds_count", shape="512x512", batch="4") == 2
    assert _value(registry, "vllm_omni:diffusion_step_seconds_sum", shape="512x512", batch="4") == 0.5
    assert _value(registry, "vllm_omni:diffusion_preemptions_total") == 1
    assert _value(registry, "vllm_omni:diffusion_deadline_misses_total") == 1


def test_compiles_and_captures_count_the_increase_by_phase():
    registry = CollectorRegistry()
    metrics = DiffusionStepMetrics(registry, "m")
    for name in ("vllm_omni:diffusion_graph_compiles_total", "vllm_omni:diffusion_cuda_graph_captures_total"):
        assert registry.get_sample_value(name, {"model_name": "m", "phase": "serving"}) == 0  # exported at once
    metrics.observe_compiles(0, None)  # eager: nothing
    metrics.observe_compiles(0, CompileStats(compiles=3, captures=12))  # the warm-up's, with the first output
    metrics.observe_compiles(0, CompileStats(compiles=3, captures=12))  # nothing new
    metrics.observe_compiles(0, CompileStats(compiles=4, captures=14, serving_compiles=1, serving_captures=2))
    assert _value(registry, "vllm_omni:diffusion_graph_compiles_total", phase="warmup") == 3
    assert _value(registry, "vllm_omni:diffusion_cuda_graph_captures_total", phase="warmup") == 12
    assert _value(registry, "vllm_omni:diffusion_graph_compiles_total", phase="serving") == 1
    assert _value(registry, "vllm_omni:diffusion_cuda_graph_captures_total", phase="serving") == 2
    # A restarted worker counts from 0: its warm-up is counted again, not subtracted.
    metrics.observe_compiles(0, CompileStats(compiles=2, captures=10))
    assert _value(registry, "vllm_omni:diffusion_graph_compiles_total", phase="warmup") == 5
    assert _value(registry, "vllm_omni:diffusion_cuda_graph_captures_total", phase="warmup") == 22


def test_memory_admission_gauges_per_stage():
    metrics = OmniMetrics("m")
    metrics.diffusion_steps.observe(StepStats("64x64"), stage_id=0)  # no budget (CPU, no flag): no series
    assert not any(name.startswith("vllm_omni:diffusion_memory") for name, _ in samples(metrics))
    metrics.diffusion_steps.observe(StepStats("64x64", reserved_bytes=3 * 2**20, budget_bytes=2**30), stage_id=1)
    got = samples(metrics)
    stage = (("model_name", "m"), ("stage", "1"))
    assert got[("vllm_omni:diffusion_memory_reserved_bytes", stage)] == 3 * 2**20
    assert got[("vllm_omni:diffusion_memory_budget_bytes", stage)] == 2**30
