"""The diffusion series of /metrics: step time per (shape, batch), and the compiled path's compiles and captures
split into start-up warm-up and serving time (a stall) from the worker's cumulative counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from vllm_omni.entrypoints.openai.diffusion_metrics import DiffusionStepMetrics
from vllm_omni.outputs import CompileStats, StepStats


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
