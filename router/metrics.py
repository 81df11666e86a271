"""Prometheus metrics of the router (`GET /metrics`), on a registry of its own.

Counters move as requests finish; per-worker gauges (health, breaker state, in-flight requests)
are read from the worker registry at scrape time, so they cost nothing per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from router.workers import Worker, WorkerRegistry

BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


class _WorkerCollector:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    def collect(self):
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("pdserve_router_worker_healthy",
                                    "1 if the worker is admitted by health checks", labels=labels)
        breaker = GaugeMetricFamily("pdserve_router_worker_breaker_state",
                                    "Circuit breaker: 0 closed, 1 half open, 2 open",
                                    labels=labels)
        inflight = GaugeMetricFamily("pdserve_router_worker_inflight_requests",
                                     "Requests sent to the worker and not yet finished",
                                     labels=labels)
        for w in self.registry.all():
            key = [w.url, w.role.value]
            healthy.add_metric(key, 1.0 if w.health.value == "healthy" else 0.0)
            breaker.add_metric(key, BREAKER_VALUES[w.breaker.state.value])
            inflight.add_metric(key, w.inflight)
        yield healthy
        yield breaker
        yield inflight


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry):
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "pdserve_router_http_requests", "HTTP requests by route and status",
            ["route", "status"], registry=self.registry)
        self.latency = Histogram(
            "pdserve_router_request_duration_seconds",
            "Time to the full answer of non-streaming requests, and to the end of streams",
            ["route"], buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry)
        self.upstream_failures = Counter(
            "pdserve_router_upstream_failures",
            "Failed legs by worker, role and kind (connect, timeout, disconnect, status, stream, "
            "stalled)",
            ["worker", "role", "kind"], registry=self.registry)
        self.retries = Counter(
            "pdserve_router_retries", "Legs sent again after a refused connection", ["role"],
            registry=self.registry)
        self.registry.register(_WorkerCollector(workers))
        self._counted: dict[tuple[str, int], object] = {}  # labelled children, looked up once
        self._timed: dict[str, object] = {}

    def count_request(self, route: str, status: int, seconds: float | None) -> None:
        """One finished HTTP request; `seconds` (inference routes) goes to the histogram."""
        child = self._counted.get((route, status))
        if child is None:
            child = self._counted[(route, status)] = self.http_requests.labels(route, str(status))
        child.inc()
        if seconds is not None:
            timer = self._timed.get(route)
            if timer is None:
                timer = self._timed[route] = self.latency.labels(route)
            timer.observe(seconds)

    def on_leg_failure(self, worker: Worker, kind: str) -> None:
        self.upstream_failures.labels(worker.url, worker.role.value, kind).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
