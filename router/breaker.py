"""Per-worker circuit breaker.

Lifecycle:  closed --(failure_threshold consecutive failures)--> open
            open --(timeout elapsed)--> half_open: one probe request at a time is let through
            half_open --(success_threshold successes)--> closed;  any failure --> open again

Only the side that failed is charged: the dispatcher records a failure on the worker whose own
leg broke (transport error, timeout, 5xx), never on its healthy partner. Client errors (4xx)
are the request's fault and count as successes of the worker.
"""

from __future__ import annotations

import enum
import time


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, success_threshold: int, timeout_s: float,
                 enabled: bool = True, clock=time.monotonic):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.clock = clock
        self._state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.half_open_successes = 0
        self.opened_at = 0.0
        self.probe_in_flight = False
        self.total_failures = 0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self.clock() - self.opened_at >= self.timeout_s:
            self._state = BreakerState.HALF_OPEN
            self.half_open_successes = 0
            self.probe_in_flight = False
        return self._state

    def allows(self) -> bool:
        """Whether a new request may go to this worker now (does not reserve the probe)."""
        if not self.enabled or self._state is BreakerState.CLOSED:  # the hot path
            return True
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self.probe_in_flight

    def on_dispatch(self) -> None:
        if self.enabled and self._state is not BreakerState.CLOSED \
                and self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self._state is not BreakerState.CLOSED and self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = False
            self.half_open_successes += 1
            if self.half_open_successes >= self.success_threshold:
                self._state = BreakerState.CLOSED

    def record_failure(self) -> None:
        self.total_failures += 1
        self.consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold
        ):
            self._trip()

    def release_probe(self) -> None:
        """A half-open probe ended without a verdict (cancelled): let another one through."""
        self.probe_in_flight = False

    def _trip(self) -> None:
        self._state = BreakerState.OPEN
        self.opened_at = self.clock()
        self.probe_in_flight = False
        self.times_opened += 1
