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

Requests already sent to a worker that gets ejected: if its checks got no HTTP answer at all
(a hung process, a lost machine), those requests that have received nothing since it went
silent are failed at once with 503 instead of waiting for --request-timeout-secs (and again at
each failed check while it stays ejected); requests still receiving data go on. A worker that
answers its checks with an error (a draining or degraded service) is ejected for new requests,
but what it is still working on is left to finish.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from router.http_client import UpstreamStalled
from router.workers import Health, Worker, WorkerRegistry

logger = logging.getLogger(__name__)


def apply_check(worker: Worker, passed: bool, error: str | None, failure_threshold: int,
                success_threshold: int, answered: bool | None = None,
                now: float | None = None) -> None:
    """One check's verdict applied to the worker's state (pure bookkeeping, testable alone).
    `answered`: the check got an HTTP answer (by default: it passed)."""
    if answered if answered is not None else passed:
        worker.unresponsive_since = None
    elif worker.unresponsive_since is None:
        worker.unresponsive_since = time.monotonic() if now is None else now
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


def cut_stalled_legs(worker: Worker) -> int:
    """Fails the requests of an ejected, unresponsive worker that have received nothing since
    it went silent; returns how many."""
    since = worker.unresponsive_since
    if worker.health is not Health.EJECTED or since is None:
        return 0
    cut = 0
    for leg in list(worker.open_legs):
        response = leg.response
        if response is None or response.complete or response.error is not None:
            continue
        if response.last_data < since:
            response.abandon(UpstreamStalled(
                f"stopped answering health checks ({worker.last_check_error}) and sent "
                "nothing for this request since; it was ejected"))
            cut += 1
    if cut:
        logger.warning("failed %d request(s) stalled on ejected worker %s", cut, worker.url)
    return cut


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
        passed, answered, error = False, False, None
        try:
            async with self.session.get(
                worker.url + self.endpoint, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                await resp.read()
                answered = True
                passed = resp.status == 200
                error = None if passed else f"health check answered {resp.status}"
        except asyncio.TimeoutError:
            error = f"health check timed out after {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            error = f"health check failed: {exc}"
        if self.registry.by_url.get(worker.url) is worker:  # not removed meanwhile
            apply_check(worker, passed, error, self.failure_threshold, self.success_threshold,
                        answered)
            if not passed:
                cut_stalled_legs(worker)

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
