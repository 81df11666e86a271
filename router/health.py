"""Periodic health checks: eject failing workers and re-admit them when they recover.

Every `--health-check-interval-secs` each registered worker gets `GET <url><endpoint>` with
`--health-check-timeout-secs`. A 200 is a pass; anything else (refused, timeout, a hung
process, a 503 from a draining service) is a failure. Thresholds (worker states in
`workers.py`):

    pending  --1 pass-->                            healthy   (a new worker is admitted at once)
    healthy  --health_failure_threshold fails-->    ejected
    ejected  --health_success_threshold passes-->   healthy

A newly added worker is checked immediately rather than at the next tick, so that a router
started next to its workers becomes ready as soon as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from router.workers import Health, Worker, WorkerRegistry

logger = logging.getLogger(__name__)


def apply_check(worker: Worker, passed: bool, error: str | None, failure_threshold: int,
                success_threshold: int) -> None:
    """One check's verdict applied to the worker's state (pure bookkeeping, testable alone)."""
    if passed:
        worker.consecutive_check_failures = 0
        worker.consecutive_check_successes += 1
        worker.last_check_error = None
        needed = 1 if worker.health is Health.PENDING else success_threshold
        if worker.health is not Health.HEALTHY and worker.consecutive_check_successes >= needed:
            logger.info("worker %s (%s) admitted", worker.url, worker.role.value)
            worker.health = Health.HEALTHY
        return
    worker.consecutive_check_successes = 0
    worker.consecutive_check_failures += 1
    worker.last_check_error = error
    if worker.health is Health.HEALTHY and worker.consecutive_check_failures >= failure_threshold:
        logger.warning("worker %s (%s) ejected: %s", worker.url, worker.role.value, error)
        worker.health = Health.EJECTED


class HealthChecker:
    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, *,
                 endpoint: str, interval_s: float, timeout_s: float, failure_threshold: int,
                 success_threshold: int):
        self.registry = registry
        self.session = session
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._pending_checks: set[asyncio.Task] = set()

    async def check(self, worker: Worker) -> None:
        passed, error = False, None
        try:
            async with self.session.get(
                worker.url + self.endpoint, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                await resp.read()
                passed = resp.status == 200
                error = None if passed else f"health check answered {resp.status}"
        except asyncio.TimeoutError:
            error = f"health check timed out after {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            error = f"health check failed: {exc}"
        if self.registry.by_url.get(worker.url) is worker:  # not removed meanwhile
            apply_check(worker, passed, error, self.failure_threshold, self.success_threshold)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.all()))

    def check_soon(self, worker: Worker) -> None:
        """Checks a worker now, in the background (used when one is added)."""
        task = asyncio.get_running_loop().create_task(self.check(worker))
        self._pending_checks.add(task)
        task.add_done_callback(self._pending_checks.discard)

    async def run_forever(self) -> None:
        while True:
            started = time.monotonic()
            await self.check_all()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
