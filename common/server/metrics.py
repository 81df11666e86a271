"""Prometheus metrics of one service (`GET /metrics`), on a registry of its own.

Counters and histograms are updated as requests finish; per-rank gauges are read from the load
board at scrape time, so they are never older than the ranks' last snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from common.loads.snapshot import LoadSnapshot
from common.server.frontend import RequestOutput

SNAPSHOT_GAUGES = (
    ("num_running_reqs", "Requests in the running batch"),
    ("num_waiting_reqs", "Requests waiting (incl. PD bootstrap/prealloc/transfer queues)"),
    ("num_used_tokens", "KV tokens held"),
    ("num_total_tokens", "KV tokens held plus tokens still to allocate or compute"),
    ("num_active_tokens", "num_total_tokens minus KV still in flight"),
    ("max_total_num_tokens", "KV pool capacity in tokens"),
    ("token_usage", "KV usage: used / capacity"),
    ("num_bootstrap_reqs", "PD prefill: requests waiting for decode's page indices"),
    ("num_inflight_reqs", "PD prefill: requests whose KV is being sent (pages held)"),
    ("num_prealloc_reqs", "PD decode: requests waiting for the prefill topology or pages"),
    ("num_transfer_reqs", "PD decode: requests whose KV is arriving"),
    ("num_retracted_reqs", "PD decode: requests retracted for lack of KV, resumed first"),
)


class _BoardCollector:
    def __init__(self, read: Callable[[], list[LoadSnapshot | None]]):
        self.read = read

    def collect(self):
        snaps = [s for s in self.read() if s is not None]
        now = time.time()
        for name, doc in SNAPSHOT_GAUGES:
            family = GaugeMetricFamily(f"pdserve_{name}", doc, labels=["dp_rank"])
            for s in snaps:
                family.add_metric([str(s.dp_rank)], getattr(s, name))
            yield family
        age = GaugeMetricFamily("pdserve_load_snapshot_age_seconds",
                                "Seconds since the rank last published", labels=["dp_rank"])
        for s in snaps:
            age.add_metric([str(s.dp_rank)], max(0.0, now - s.timestamp))
        yield age


class ServiceMetrics:
    def __init__(self, read_loads: Callable[[], list[LoadSnapshot | None]]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "pdserve_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=self.registry,
        )
        self.finished = Counter(
            "pdserve_requests_finished", "Generation requests by finish reason", ["reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens", registry=self.registry
        )
        self.e2e_latency = Histogram(
            "pdserve_e2e_request_latency_seconds", "End-to-end latency of generation requests",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.registry.register(_BoardCollector(read_loads))

    def on_finish(self, out: RequestOutput) -> None:
        reason = out.finish_reason.type if out.finish_reason else "unknown"
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.e2e_latency.observe(out.e2e_latency)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
