"""The worker registry: every prefill, decode or plain worker the router knows, and its state.

Lifecycle of one worker (health checks drive it, see `health.py`):

    pending --(first passed check)--> healthy --(health_failure_threshold failed checks)-->
    ejected --(health_success_threshold passed checks)--> healthy ...

A worker is *available* for new requests when it is healthy and its circuit breaker allows a
request. `--disable-health-check` makes every worker healthy at once and forever.
Workers are added at start-up from the flags and at run time through `POST /workers`; removing
one takes it out of every list at once (requests already sent to it run to their end).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from yarl import URL

from router.breaker import CircuitBreaker
from router.loads import WorkerLoad


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    REGULAR = "regular"  # plain mode: a colocated `pdserve serve`


class Health(str, enum.Enum):
    PENDING = "pending"
    HEALTHY = "healthy"
    EJECTED = "ejected"


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    breaker: CircuitBreaker
    bootstrap_port: int | None = None
    health: Health = Health.PENDING
    consecutive_check_failures: int = 0
    consecutive_check_successes: int = 0
    last_check_error: str | None = None
    # The legs (upstream.Leg) of requests the router has sent and not yet seen finish.
    open_legs: set = field(default_factory=set)
    # Monotonic time of the first of the latest health checks in a row that got no HTTP answer
    # at all (timeout, refused); None while the worker answers (even with an error status).
    unresponsive_since: float | None = None
    load: WorkerLoad | None = None  # the latest /v1/loads poll
    host: str = field(init=False)
    port: int = field(init=False)
    scheme: str = field(init=False)
    base_path: str = field(init=False)  # a URL path prefix, if the worker sits under one

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        parsed = URL(self.url)
        self.host = parsed.host or ""
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.scheme = parsed.scheme
        self.base_path = parsed.path.rstrip("/")

    @property
    def inflight(self) -> int:
        return len(self.open_legs)

    @property
    def available(self) -> bool:
        return self.health is Health.HEALTHY and self.breaker.allows()

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "health": self.health.value,
            "available": self.available,
            "breaker": self.breaker.state.value,
            "inflight": self.inflight,
            "last_check_error": self.last_check_error,
            "num_dp_slots": None if self.load is None else self.load.num_dp_slots,
        }


class WorkerRegistry:
    def __init__(self, make_breaker, health_checks_enabled: bool = True):
        self._make_breaker = make_breaker
        self.health_checks_enabled = health_checks_enabled
        self.by_url: dict[str, Worker] = {}
        self.by_role: dict[Role, list[Worker]] = {role: [] for role in Role}
        self.listeners: list = []  # callables(event, worker): "added" / "removed"

    def add(self, url: str, role: Role, bootstrap_port: int | None = None) -> Worker:
        url = url.rstrip("/")
        if url in self.by_url:
            raise ValueError(f"worker {url} is already registered "
                             f"(as {self.by_url[url].role.value})")
        worker = Worker(url, role, self._make_breaker(), bootstrap_port)
        if not self.health_checks_enabled:
            worker.health = Health.HEALTHY
        self.by_url[url] = worker
        # Lists are replaced, not mutated, so a loop over an old list is never disturbed.
        self.by_role[role] = [*self.by_role[role], worker]
        for listener in self.listeners:
            listener("added", worker)
        return worker

    def remove(self, url: str) -> Worker:
        worker = self.by_url.pop(url.rstrip("/"))
        self.by_role[worker.role] = [w for w in self.by_role[worker.role] if w is not worker]
        for listener in self.listeners:
            listener("removed", worker)
        return worker

    def all(self) -> list[Worker]:
        return list(self.by_url.values())

    def available(self, role: Role) -> list[Worker]:
        return [w for w in self.by_role[role] if w.available]
