"""The step scheduler's Prometheus series: what one finished request's `StepStats` adds to /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.entrypoints.openai.metrics import OmniMetrics
from vllm_omni.outputs import StepStats


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
    shape = (("model_name", "m"), ("shape", "64x64+cfg"))
    assert got[("vllm_omni:diffusion_preemptions_total", model)] == 2
    assert got[("vllm_omni:diffusion_deadline_misses_total", model)] == 1
    assert got[("vllm_omni:diffusion_requests_waiting", model)] == 0  # the latest request's snapshot
    assert got[("vllm_omni:diffusion_requests_running", model)] == 0
    assert got[("vllm_omni:diffusion_step_seconds_count", shape)] == 4
    assert got[("vllm_omni:diffusion_step_seconds_bucket", (("le", "0.0025"), *shape))] == 2
