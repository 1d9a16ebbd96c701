"""Per-stage series on `/metrics` (issue 18).

`vllm_omni:stage_duration_seconds` keeps two stages of one type apart (thinker -> talker), and vLLM's own
Prometheus stat loggers run per AR stage replica: thinker + talker, two replicas of the thinker and a
data-parallel-2 talker in one process, each with its own `vllm:*` series, no duplicate registration, nothing
left on the process-wide registry to collide on."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.entrypoints.openai.metrics import OmniMetrics

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_omni.catalog.tiny import build_tiny

    return EngineArgs(model=str(build_tiny("qwen2")), max_model_len=128, enforce_eager=True).create_engine_config()


def test_stage_durations_are_kept_per_stage_id():
    metrics = OmniMetrics("m")
    # a thinker -> talker -> vocoder request: "llm" is the talker's time (the later AR stage overwrote it)
    metrics.observe_stages({"llm": 2.0, "stage-0-llm": 1.0, "stage-1-llm": 2.0, "generation": 0.5,
                            "stage-2-generation": 0.5, "diffusion.denoise": 0.25, "e2e": 4.0})
    sums = {(s.labels["stage"], s.labels["stage_id"], s.labels["stage_type"]): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples if s.name == "vllm_omni:stage_duration_seconds_sum"}
    assert sums == {("llm", "0", "llm"): 1.0, ("llm", "1", "llm"): 2.0, ("generation", "2", "generation"): 0.5,
                    ("diffusion.denoise", "", ""): 0.25, ("e2e", "", ""): 4.0}


def _iteration(ttft: float):
    from vllm.v1.metrics.stats import IterationStats

    stats = IterationStats()
    stats.num_generation_tokens = 1
    stats.time_to_first_tokens_iter = [ttft]
    return stats


def test_every_stage_replica_and_engine_has_its_own_vllm_series(vllm_config):
    from prometheus_client import CollectorRegistry
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_omni.engine.stage_metrics import stage_prometheus_logger

    # (stage id, replica, vLLM engine indexes): thinker replicas 0 and 1, a DP-2 talker
    layout = [(0, 0, [0]), (0, 1, [0]), (1, 0, [0, 1])]
    registries = {(stage, replica): CollectorRegistry() for stage, replica, _ in layout}
    for stage, replica, engines in layout:  # through vLLM's own manager, as AsyncLLM builds it
        manager = StatLoggerManager(vllm_config, engine_idxs=engines, enable_default_loggers=False,
                                    custom_stat_loggers=[stage_prometheus_logger(registries[stage, replica])])
        for engine in engines:
            running = 10 * stage + 2 * replica + engine + 1
            manager.record(SchedulerStats(num_running_reqs=running), _iteration(0.01), engine_idx=engine)
    metrics = OmniMetrics("m")
    metrics.add_stage_registries(lambda: [(stage, "llm", replica, reg) for (stage, replica), reg in registries.items()])
    text = generate_latest(metrics.registry).decode()
    seen, samples = set(), {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert (s.name, tuple(sorted(s.labels.items()))) not in seen, f"duplicate sample {s}"
            seen.add((s.name, tuple(sorted(s.labels.items()))))
            samples[s.name, s.labels.get("stage_id"), s.labels.get("replica"), s.labels.get("engine")] = s.value
    running = {k[1:]: v for k, v in samples.items() if k[0] == "vllm:num_requests_running"}
    assert running == {("0", "0", "0"): 1, ("0", "1", "0"): 3, ("1", "0", "0"): 11, ("1", "0", "1"): 12}
    for stage, replica, engine in running:
        assert samples["vllm:time_to_first_token_seconds_count", stage, replica, engine] == 1
        # vLLM's helper classes (perf counters) land on the replica's registry too, not the process-wide one
        assert ("vllm:estimated_flops_per_gpu_total", stage, replica, engine) in samples
    assert 'stage_type="llm"' in text
