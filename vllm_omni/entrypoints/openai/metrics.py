"""Prometheus metrics of the HTTP server, on a registry of its own (one per app).

`vllm_omni:requests_running` counts requests inside the engine right now; a client that disconnects
mid-request must bring it back down (the request is aborted in the engine).

`vllm_omni:stage_duration_seconds` is kept per stage (`stage_id`, `stage_type`), so a pipeline with two stages
of one type (prompt rewriter -> image, thinker -> talker) keeps both stages' times.

`/metrics` also renders vLLM's own `vllm:*` series of every AR stage replica (each keeps them in a registry of
its own, `engine/stage_metrics.py`), labelled `stage_id`, `stage_type` and `replica`, and the process-wide
registry (vLLM's HTTP instrumentator on AR-first servers, process and Python collectors).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from vllm_omni.entrypoints.openai.diffusion_metrics import DiffusionStepMetrics

_STAGE_KEY = re.compile(r"stage-(?P<id>\d+)-(?P<name>(?P<type>[a-z]+)(?:\..+)?)")
"""A per-stage `stage_durations` key (`StageConfig.name`, then `.<phase>`)."""
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class OmniMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.http_requests = Counter(
            "vllm_omni:http_requests", "HTTP requests by route and status.", ["model_name", "route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "vllm_omni:http_request_latency_seconds", "HTTP request latency by route.", ["model_name", "route"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.stage_latency = Histogram(
            "vllm_omni:stage_duration_seconds", "Per-stage (and per-phase) durations reported by the engine.",
            ["model_name", "stage", "stage_id", "stage_type"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.engine_requests = Counter(
            "vllm_omni:engine_requests", "Engine requests by outcome (finished, error, aborted).",
            ["model_name", "outcome"], registry=self.registry,
        )
        self.cache_block_steps = Counter(
            "vllm_omni:diffusion_cache_block_steps", "DiT block-steps of diffusion requests by cache quality, backend "
            "and outcome (computed, reused = cache hits).", ["model_name", "quality", "backend", "outcome"],
            registry=self.registry,
        )
        self.running = Gauge(
            "vllm_omni:requests_running", "Requests currently inside the engine.", ["model_name"],
            registry=self.registry,
        )
        self.diffusion_steps = DiffusionStepMetrics(self.registry, model_name)

        self.replica_dispatched = Gauge(
            "vllm_omni:stage_replica_dispatched_requests", "Requests given to each stage replica since start.",
            ["model_name", "stage_id", "replica"], registry=self.registry,
        )
        self.replica_serving = Gauge(
            "vllm_omni:stage_replica_serving", "1 while a stage replica takes requests (0: dead or restarting).",
            ["model_name", "stage_id", "replica"], registry=self.registry,
        )

    def observe_replicas(self, stages: list[dict]) -> None:
        """Copies the engine's per-replica state (`stage_health()`) into the gauges, at scrape time."""
        for stage in stages:
            for replica, (state, count) in enumerate(zip(stage["replicas"], stage["dispatched"], strict=True)):
                labels = (self.model_name, str(stage["stage_id"]), str(replica))
                self.replica_dispatched.labels(*labels).set(count)
                self.replica_serving.labels(*labels).set(state == "serving")

    def observe_stages(self, stage_durations: dict[str, float]) -> None:
        """A finished request's durations, one sample per stage: `stage-<id>-<type>[.<phase>]` keys are observed
        as `stage="<type>[.<phase>]"` with their `stage_id` / `stage_type`; the by-type twins of those keys (the
        later stage of a type overwrote the earlier one's) are skipped; other keys (`e2e`) have no stage."""
        per_stage = {key: match for key in stage_durations if (match := _STAGE_KEY.fullmatch(key))}
        twins = {match["name"] for match in per_stage.values()}
        for key, seconds in stage_durations.items():
            if (match := per_stage.get(key)) is not None:
                labels = (match["name"], match["id"], match["type"])
            elif key in twins:
                continue
            else:
                labels = (key, "", "")
            self.stage_latency.labels(self.model_name, *labels).observe(seconds)

    # ---- diffusion cache (docs/cache.md) ---------------------------------------------------------------------

    def observe_cache(self, cache: dict | None) -> None:
        """Block-steps a request's cache computed and reused (hits), by quality and backend."""
        if cache is None:
            return
        for outcome in ("computed", "reused"):
            self.cache_block_steps.labels(self.model_name, cache["quality"], cache["backend"], outcome).inc(
                cache[f"{outcome}_block_steps"])

    def request_started(self) -> None:
        self.running.labels(self.model_name).inc()

    def request_ended(self, outcome: str) -> None:
        self.running.labels(self.model_name).dec()
        self.engine_requests.labels(self.model_name, outcome).inc()

    def install(self, app: FastAPI) -> None:
        app.add_middleware(_HttpMetricsMiddleware, metrics=self)

    def add_stage_registries(self, stages: Callable[[], list[tuple[int, str, int, CollectorRegistry]]]) -> None:
        """Render the `vllm:*` series of the AR stage replicas that `stages()` lists as (stage id, stage type,
        replica, registry); read at every scrape: a restarted stage has a new registry."""
        self.registry.register(StageSeriesCollector(stages))

    def render(self) -> Response:
        body = generate_latest(self.registry) + generate_latest(REGISTRY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


class StageSeriesCollector:
    """Every stage replica registry's series, one family per name, each sample labelled with its stage and
    replica (vLLM's own `engine` label stays: the data-parallel rank inside that replica's AsyncLLM)."""

    def __init__(self, stages: Callable[[], list[tuple[int, str, int, CollectorRegistry]]]) -> None:
        self.stages = stages

    def describe(self) -> list[Any]:
        return []  # collected lazily: the stage series appear only once the stages run

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for stage_id, stage_type, replica, registry in self.stages():
            labels = {"stage_id": str(stage_id), "stage_type": stage_type, "replica": str(replica)}
            for family in registry.collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                merged.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]
        yield from families.values()


class _HttpMetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so client disconnects still reach the route handlers."""

    def __init__(self, app, metrics: OmniMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            if path != "/metrics":
                m = self.metrics
                m.http_requests.labels(m.model_name, path, str(status)).inc()
                m.http_latency.labels(m.model_name, path).observe(time.perf_counter() - start)
