"""One request from the router to one worker (a *leg*), and how its failures are classified.

Legs travel over `http_client.ConnectionPool` (pooled keep-alive connections, TCP_NODELAY, a
connect timeout and a whole-request timeout `--request-timeout-secs`, streams included).
`new_session` makes the aiohttp session used off the hot path (health checks, load polls,
info routes), with the same bounds.

Lifecycle of a leg:  created --open()--> headers received --read()/readany()--> settled
`open()` counts the request in `worker.open_legs` and reserves a half-open breaker probe;
`finish()` settles it exactly once: success, failure (charged to this worker's breaker) or
no verdict (cancelled because the *other* side failed or the client left: nobody is charged).

Failure kinds and whether the work may have started on the worker:
    connect     refused / unreachable / connect timeout: nothing was sent -> safe to retry
    timeout     no complete answer in time                -> may be running, never replayed
    disconnect  the connection broke after sending        -> may be running, never replayed
    stalled     given up: the worker was ejected by health checks and sent nothing since it
                began failing them (see health.cut_stalled_legs) -> never replayed
    status      the worker answered >= 500                -> it ran (or refused) the request
    stream      the worker's stream carried an error event
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import aiohttp
from aiohttp import web

from common.server.errors import error_body, error_response
from router.http_client import (
    ConnectionPool,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamResponse,
    UpstreamStalled,
    UpstreamTimeout,
)
from router.workers import Worker

JSON = "application/json"
_CONNECTING: set[asyncio.Task] = set()  # Leg.start's connect-then-send tasks


def new_session(connect_timeout_s: float, request_timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0,  # no global cap: the workers' own queues are the back-pressure
        limit_per_host=0,
        keepalive_timeout=60.0,
        ttl_dns_cache=300,
        family=socket.AF_UNSPEC,
    )
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=connect_timeout_s)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


class LegFailure(Exception):
    """A leg that did not produce a usable answer."""

    def __init__(self, worker: Worker, kind: str, message: str, status: int,
                 body: bytes | None = None, content_type: str = JSON):
        super().__init__(message)
        self.worker = worker
        self.kind = kind
        self.message = message
        self.status = status
        self.body = body  # the worker's own error body, passed to the client unchanged
        self.content_type = content_type

    @property
    def maybe_started(self) -> bool:
        return self.kind != "connect"

    def response(self, request_id: str) -> web.Response:
        if self.body is not None:
            return web.Response(body=self.body, status=self.status,
                                headers={"Content-Type": self.content_type,
                                         "X-Request-Id": request_id})
        response = error_response(self.message, None, self.status)
        response.headers["X-Request-Id"] = request_id
        return response

    def error_event(self) -> dict:
        return error_body(self.message, None, self.status)


class Leg:
    def __init__(self, pool: ConnectionPool, worker: Worker, path: str, payload: bytes,
                 extra_headers: bytes, on_failure=None):
        self.pool = pool
        self.worker = worker
        self.path = path
        self.payload = payload
        self.extra_headers = extra_headers
        self.on_failure = on_failure  # metrics hook: (worker, kind) -> None
        self.response: UpstreamResponse | None = None
        self.settled = False
        self.opened = False
        self._sending: asyncio.Task | None = None  # start(): connecting first

    async def open(self) -> UpstreamResponse:
        """Sends the request; returns once the worker's status line and headers are in."""
        worker = self.worker
        worker.open_legs.add(self)
        worker.breaker.on_dispatch()
        self.opened = True
        pool, path = self.pool, worker.base_path + self.path
        try:
            # Sent first, then awaited: the answer is reachable (self.response) while the
            # worker thinks, so that health checks can give up on it (health.cut_stalled_legs).
            self.response = await pool.send(worker.scheme, worker.host, worker.port, path,
                                             self.payload, self.extra_headers)
            await self.response.wait_head()
        except BaseException as exc:
            raise self.failure_from(exc) from None
        return self.response

    def start(self, on_done: Callable[[LegFailure | None, bytes], None],
              charge: Callable[[], bool]) -> None:
        """Callback style, for a leg that nobody awaits (the PD prefill leg): sends the request
        (at once on an idle pooled connection, else from a task that connects first) and, when
        the whole answer is in or the leg failed, settles the leg and calls
        `on_done(failure or None, body)`. A >= 500 answer is charged if `charge()` says so.
        `finish(None)` before that cancels it (no callback, nothing charged)."""
        worker = self.worker
        worker.open_legs.add(self)
        worker.breaker.on_dispatch()
        self.opened = True

        def complete() -> None:
            response = self.response
            if response.error is not None:
                failure = self.failure_from(response.error)
                on_done(failure, b"")
                return
            body = response.body_nowait()
            if response.status >= 400:
                on_done(self._status_failure(body, charge()), body)
            else:
                self.finish(True)
                on_done(None, body)

        self.response = self.pool.send_nowait(
            worker.scheme, worker.host, worker.port, worker.base_path + self.path,
            self.payload, self.extra_headers)
        if self.response is not None:
            self.response.when_done(complete)
            return

        async def connect_and_send() -> None:
            try:
                self.response = await self.pool.send(
                    worker.scheme, worker.host, worker.port, worker.base_path + self.path,
                    self.payload, self.extra_headers)
            except BaseException as exc:
                failure = self.failure_from(exc)
                if not isinstance(failure, LegFailure):
                    raise failure from None
                on_done(failure, b"")
                return
            finally:
                self._sending = None
            self.response.when_done(complete)

        self._sending = asyncio.get_running_loop().create_task(connect_and_send())
        _CONNECTING.add(self._sending)  # held until done, even if nobody else holds the leg
        self._sending.add_done_callback(_CONNECTING.discard)

    async def read(self) -> bytes:
        try:
            return await self.response.read()
        except BaseException as exc:
            raise self.failure_from(exc) from None

    def failure_from(self, exc: BaseException) -> BaseException:
        """Converts a transport exception into a LegFailure (charged); lets cancellation
        through (not charged)."""
        worker, role = self.worker, self.worker.role.value
        if isinstance(exc, UpstreamConnectError):
            failure = LegFailure(worker, "connect",
                                 f"{role} worker {worker.url} is unreachable: {exc}", 503)
        elif isinstance(exc, UpstreamStalled):
            failure = LegFailure(worker, "stalled", f"{role} worker {worker.url} {exc}", 503)
        elif isinstance(exc, UpstreamTimeout | asyncio.TimeoutError):
            failure = LegFailure(worker, "timeout",
                                 f"{role} worker {worker.url} did not answer in time", 504)
        elif isinstance(exc, UpstreamDisconnected | OSError):
            failure = LegFailure(worker, "disconnect",
                                 f"{role} worker {worker.url} broke the connection: "
                                 f"{exc or type(exc).__name__}", 502)
        else:
            self.finish(None)
            return exc
        return self.fail(failure)

    async def status_failure(self, charge: bool = True) -> LegFailure:
        """The worker answered >= 400: its own body, to pass on unchanged. A 4xx is the
        request's fault (the worker is fine); a 5xx is charged unless `charge` is False (the
        dispatcher's call when the partner leg's worker is the likelier culprit)."""
        return self._status_failure(await self.read(), charge)

    def _status_failure(self, body: bytes, charge: bool) -> LegFailure:
        status = self.response.status
        content_type = self.response.content_type
        failure = LegFailure(self.worker, "status" if status >= 500 else "client_error",
                             f"{self.worker.role.value} worker {self.worker.url} answered "
                             f"{status}", status, body, content_type)
        if status < 500:
            self.finish(True)
        elif charge:
            self.fail(failure)
        else:
            self.finish(None)
        return failure

    def finish(self, success: bool | None) -> None:
        """Settles the leg once: True success, False failure (charged), None no verdict."""
        if self.settled:
            return
        self.settled = True
        if self._sending is not None and self._sending is not asyncio.current_task():
            self._sending.cancel()
        worker = self.worker
        if self.opened:
            worker.open_legs.discard(self)
        if success is True:
            worker.breaker.record_success()
        elif success is False:
            worker.breaker.record_failure()
        else:
            worker.breaker.release_probe()
        if self.response is not None:
            self.response.on_done = None
        if self.response is not None and success is not True:
            self.response.close()  # a half-read answer: drop the connection, do not pool it
        elif self.response is not None:
            self.response.release()

    def fail(self, failure: LegFailure) -> LegFailure:
        """Charges a failure found while reading the body (a broken or error stream)."""
        if self.on_failure is not None:
            self.on_failure(self.worker, failure.kind)
        self.finish(False)
        return failure
