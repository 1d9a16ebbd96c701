"""vLLM's own stat loggers for an AR stage, with the stage's Prometheus series kept apart.

vLLM's `PrometheusStatLogger` registers its `vllm:*` series on the process-wide registry and unregisters any
it finds first, so two AR stages in one process (Qwen3-Omni's thinker and talker) would overwrite each other.
Each AR stage gets a registry of its own instead; the HTTP server's `/metrics` renders every stage's registry
with `stage_id` / `stage_type` labels added (`entrypoints/openai/metrics.py`).
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.loggers import PrometheusStatLogger


def stage_prometheus_logger(registry: CollectorRegistry) -> type[PrometheusStatLogger]:
    """vLLM's Prometheus stat logger class, bound to `registry` (vLLM's `stat_loggers` take classes)."""

    class StagePrometheusStatLogger(PrometheusStatLogger):
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    return StagePrometheusStatLogger
