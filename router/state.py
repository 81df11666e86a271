"""The router's shared state: arguments, worker registry, policies, HTTP session, background tasks.

Lifecycle: `RouterState(args)` -> `await start()` (session, workers from the flags, first health
checks, then the health-check, load-poll and eviction loops) -> serve -> `await stop()`
(cancels the loops, closes pooled connections). Everything runs on one asyncio loop, so the
registry and policies need no locks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable

from aiohttp import web

from common.server.errors import ApiError
from router.breaker import CircuitBreaker
from router.config import RouterArgs
from router.health import HealthChecker
from router.http_client import ConnectionPool
from router.loads import LoadPoller
from router.metrics import RouterMetrics
from router.policies import Policy, RouteKey, make_policy
from router.upstream import Leg, new_session
from router.workers import Role, Worker, WorkerRegistry

logger = logging.getLogger(__name__)


class RouterState:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.registry = WorkerRegistry(self._new_breaker, not args.disable_health_check)
        self.policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(args.resolved_prefill_policy, args),
            Role.DECODE: make_policy(args.resolved_decode_policy, args),
            Role.REGULAR: make_policy(args.policy, args),
        }
        self.registry.listeners.append(self._on_registry_change)
        self.metrics = RouterMetrics(self.registry)
        self.rng = random.Random()
        self.session = None  # aiohttp, off the hot path
        self.pool: ConnectionPool | None = None  # the legs
        self.health: HealthChecker | None = None
        self.loops: list[asyncio.Task] = []
        self.background: set[asyncio.Task] = set()

    @property
    def pd(self) -> bool:
        return self.args.pd_disaggregation

    def _new_breaker(self) -> CircuitBreaker:
        a = self.args
        return CircuitBreaker(a.cb_failure_threshold, a.cb_success_threshold,
                              a.cb_timeout_duration_secs, enabled=not a.disable_circuit_breaker)

    def _on_registry_change(self, event: str, worker: Worker) -> None:
        if event == "removed":
            self.policies[worker.role].forget(worker)
        elif event == "added" and self.health is not None:
            self.health.check_soon(worker)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        a = self.args
        self.session = new_session(a.connect_timeout_secs, a.request_timeout_secs)
        self.pool = ConnectionPool(a.connect_timeout_secs, a.request_timeout_secs)
        for spec in a.prefill:
            self.registry.add(spec.url, Role.PREFILL, spec.bootstrap_port)
        for url in a.decode:
            self.registry.add(url, Role.DECODE)
        for url in a.worker_urls:
            self.registry.add(url, Role.REGULAR)
        if not a.disable_health_check:
            self.health = HealthChecker(
                self.registry, self.session, endpoint=a.health_check_endpoint,
                interval_s=a.health_check_interval_secs, timeout_s=a.health_check_timeout_secs,
                failure_threshold=a.health_failure_threshold,
                success_threshold=a.health_success_threshold)
            self.loops.append(asyncio.create_task(self.health.run_forever()))
        if a.needs_loads:
            poller = LoadPoller(self.registry, self.session, a.load_poll_interval_secs,
                                timeout_s=max(a.load_poll_interval_secs, 1.0))
            self.loops.append(asyncio.create_task(poller.run_forever()))
        for policy in {id(p): p for p in self.policies.values()}.values():
            self.loops.append(asyncio.create_task(policy.maintain()))

    async def stop(self) -> None:
        tasks = [*self.loops, *self.background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loops.clear()
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    def keep(self, task: asyncio.Task) -> None:
        """Holds a task that outlives its request (a prefill leg still draining)."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ---- per request ----------------------------------------------------------------------
    def pick(self, role: Role, key: RouteKey, exclude: Iterable[Worker] = ()) -> Worker:
        """A worker of `role` chosen by that role's policy; a fast 503 when none is available."""
        excluded = set(exclude)
        candidates = [w for w in self.registry.by_role[role]
                      if w not in excluded and w.available]
        if not candidates:
            raise ApiError(self.unavailable_message(role), None, 503)
        return self.policies[role].select(candidates, key)

    def unavailable_message(self, role: Role) -> str:
        workers = self.registry.by_role[role]
        name = "worker" if role is Role.REGULAR else f"{role.value} worker"
        if not workers:
            return f"no {name} is registered"
        states = ", ".join(f"{w.url}: {_why_unavailable(w)}" for w in workers)
        return f"no healthy {name} is available ({len(workers)} registered: {states})"

    def leg(self, worker: Worker, path: str, payload: bytes, request_id: str) -> Leg:
        # The id travels in the body as `rid`; the header is for tracing, and is only sent
        # when it cannot break the request head.
        header = (b"X-Request-Id: %s\r\n" % request_id.encode()
                  if len(request_id) <= 256 and request_id.isascii() and request_id.isprintable()
                  else b"")
        return Leg(self.pool, worker, path, payload, header, self.metrics.on_leg_failure)

    def backoff_s(self, retry: int) -> float:
        """Delay before retry number `retry` (1-based): exponential, capped, with jitter."""
        a = self.args
        base = min(a.retry_max_backoff_ms,
                   a.retry_initial_backoff_ms * a.retry_backoff_multiplier ** (retry - 1))
        jitter = 1.0 + a.retry_jitter_factor * (2.0 * self.rng.random() - 1.0)
        return base * jitter / 1000.0


def _why_unavailable(worker: Worker) -> str:
    if worker.health.value != "healthy":
        return worker.health.value
    return f"breaker {worker.breaker.state.value}"


STATE = web.AppKey("router_state", RouterState)
