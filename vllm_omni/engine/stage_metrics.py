"""vLLM's own stat loggers for an AR stage replica, with its Prometheus series kept apart.

vLLM's `PrometheusStatLogger` registers its `vllm:*` series on the process-wide registry and unregisters any
it finds first, so two AR stages in one process (Qwen3-Omni's thinker and talker), or two replicas of one,
would overwrite each other. Each AR stage replica gets a registry of its own instead, bound through the metric
class attributes vLLM's Prometheus classes expose for this (as its Ray wrappers do), including the helper
classes' series (perf counters, spec decoding, KV / EC connectors); the HTTP server's `/metrics` renders every
replica's registry with `stage_id` / `stage_type` / `replica` labels added (`entrypoints/openai/metrics.py`).
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.perf import PerfMetricsProm
from vllm.v1.spec_decode.metrics import SpecDecodingProm

_METRIC_CLASSES = {"_gauge_cls": Gauge, "_counter_cls": Counter, "_histogram_cls": Histogram}


def _bound(cls: type, registry: CollectorRegistry) -> type:
    """`cls` with the metric classes it uses creating their series on `registry`."""
    attrs = {name: partial(metric, registry=registry) for name, metric in _METRIC_CLASSES.items() if hasattr(cls, name)}
    return type(cls.__name__, (cls,), attrs)


def stage_prometheus_logger(registry: CollectorRegistry) -> type[PrometheusStatLogger]:
    """vLLM's Prometheus stat logger class, bound to `registry` (vLLM's `stat_loggers` take classes)."""

    class StagePrometheusStatLogger(_bound(PrometheusStatLogger, registry)):
        _spec_decoding_cls = _bound(SpecDecodingProm, registry)
        _kv_connector_cls = _bound(KVConnectorProm, registry)
        _ec_connector_cls = _bound(ECConnectorProm, registry)
        _perf_metrics_cls = _bound(PerfMetricsProm, registry)

    return StagePrometheusStatLogger
