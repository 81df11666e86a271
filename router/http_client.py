"""A lean HTTP/1.1 client for the router's hot path: one POST per leg over pooled keep-alive
connections.

Why not aiohttp's ClientSession here: on the 2-core benchmark machine it costs ~340 us of CPU
per request, against ~25 us for this client, and every routed PD request makes two of them
(see docs/benchmarks.md, Router). aiohttp's client is still used for everything off the hot
path (health checks, load polls, info routes).

What it supports is what the workers speak: `POST` with a Content-Length body; answers with
Content-Length, chunked transfer encoding, or a body that ends with the connection. TLS when the
worker URL is https. Every socket gets TCP_NODELAY, so an SSE chunk is never held back by
Nagle's algorithm.

Connection lifecycle:
    connecting -> busy (one request at a time) -> idle in the pool -> busy ... -> closed
A connection returns to the pool only after its answer was read completely and the worker did
not ask to close it; a half-read answer (client gone, other leg failed) closes it, which the
worker sees as a disconnect and aborts the request. Idle connections older than IDLE_TIMEOUT_S
are dropped before the worker's own keep-alive timeout (aiohttp: 75 s) could race a request.

Errors say whether the request can have reached the worker (see `upstream.py`):
    UpstreamConnectError   no connection was made: nothing was sent
    UpstreamTimeout        no complete answer within the request timeout
    UpstreamDisconnected   the connection broke after the request was written
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module
import time
from collections import deque

IDLE_TIMEOUT_S = 30.0
PAUSE_ABOVE = 4 * 1024 * 1024  # buffered body bytes at which reading from the socket pauses


class UpstreamError(Exception):
    pass


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamDisconnected(UpstreamError):
    pass


class UpstreamStalled(UpstreamError):
    """Given up by the router: its worker was ejected and sent nothing since it began failing
    health checks."""


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_TRAILER, _UNTIL_CLOSE, _DONE = range(7)


class UpstreamResponse:
    """One answer: status and headers once the head is in; the body as it arrives."""

    def __init__(self, conn: _Connection):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._state = _HEAD
        self._buffer = bytearray()
        self._remaining = 0
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._keep_alive = True
        self._released = False
        self._timer: asyncio.TimerHandle | None = None
        self.last_data = 0.0  # monotonic time bytes of this answer last came in (0: none yet)
        # Called once, from the protocol, when the answer is complete or has failed (for legs
        # driven by callbacks instead of a task, see upstream.Leg.start).
        self.on_done = None

    # ---- reading (the caller's side) ----------------------------------------------------
    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    @property
    def error(self) -> BaseException | None:
        return self._error

    def when_done(self, callback) -> None:
        """Calls `callback()` once the answer is complete or has failed (at once if it is)."""
        if self._state == _DONE or self._error is not None:
            callback()
        else:
            self.on_done = callback

    def body_nowait(self) -> bytes:
        """The buffered body (all of it once `complete`)."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def readany(self) -> bytes:
        """The next piece of the body; b"" once it is complete."""
        while True:
            if self._pieces:
                data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
                self._pieces.clear()
                self._buffered = 0
                self._conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            await self._wait()

    async def wait_head(self) -> None:
        """Returns once the status line and headers are in; on failure the connection is
        closed and the error raised."""
        try:
            while self._state == _HEAD:
                if self._error is not None:
                    raise self._error
                await self._wait()
        except BaseException:
            self.close()
            raise

    async def read(self) -> bytes:
        if self._state == _DONE and self._error is None:  # all in already: the usual case
            return self.body_nowait()
        chunks = []
        while data := await self.readany():
            chunks.append(data)
        return b"".join(chunks)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def release(self) -> None:
        """Done with this answer: the connection goes back to the pool if it can be reused."""
        if self._released:
            return
        self._released = True
        self._cancel_timer()
        if self._state == _DONE and self._keep_alive and self._error is None:
            self._conn.pool.put_back(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Done with this answer, whatever its state: the connection is closed."""
        if self._released:
            return
        self._released = True
        self._cancel_timer()
        self._conn.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- parsing (the protocol's side) --------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.on_done is not None and (self._state == _DONE or self._error is not None):
            on_done, self.on_done = self.on_done, None
            on_done()

    def fail(self, error: BaseException) -> None:
        if self._error is None and self._state != _DONE:
            self._error = error
        self._wake()

    def abandon(self, error: BaseException) -> None:
        """Fails the answer with `error` and closes its connection (the worker sees the
        client leave)."""
        self.fail(error)
        self._conn.close()

    def feed(self, data: bytes) -> None:
        if self._state == _HEAD:
            self._buffer += data
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._buffer[:end])
            rest = bytes(self._buffer[end + 4:])
            self._buffer.clear()
            self._parse_head(head)
            self._wake()
            if rest:
                self._feed_body(rest)
            elif self._state == _DONE:
                self._wake()
            return
        self._feed_body(data)

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        self.status = int(status_line[1])
        headers = self.headers
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("connection", "").lower() == "close" or status_line[0] == "HTTP/1.0":
            self._keep_alive = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _LENGTH if self._remaining else _DONE
        elif self.status in (204, 304) or self.status < 200:
            self._state = _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False

    def _push(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._buffered += len(data)
            if self._buffered > PAUSE_ABOVE:
                self._conn.pause()

    def _feed_body(self, data: bytes) -> None:
        state = self._state
        if state == _LENGTH:
            if len(data) >= self._remaining:
                self._push(data[:self._remaining])
                self._remaining = 0
                self._state = _DONE
            else:
                self._remaining -= len(data)
                self._push(data)
        elif state == _UNTIL_CLOSE:
            self._push(data)
        elif state != _DONE:
            self._buffer += data
            self._parse_chunks()
        self._wake()

    def _parse_chunks(self) -> None:
        buf = self._buffer
        while True:
            if self._state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0].strip() or b"0", 16)
                del buf[:end + 2]
                self._remaining = size
                self._state = _CHUNK_DATA if size else _CHUNK_TRAILER
            elif self._state == _CHUNK_DATA:
                if len(buf) < self._remaining + 2:
                    if len(buf) > 0 and len(buf) <= self._remaining:  # stream it on
                        self._push(bytes(buf))
                        self._remaining -= len(buf)
                        buf.clear()
                    return
                self._push(bytes(buf[:self._remaining]))
                del buf[:self._remaining + 2]
                self._state = _CHUNK_SIZE
            elif self._state == _CHUNK_TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                line_empty = end == 0
                del buf[:end + 2]
                if line_empty:
                    self._state = _DONE
                    return
            else:
                return

    def on_lost(self, exc: BaseException | None) -> None:
        if self._state == _UNTIL_CLOSE and exc is None:
            self._state = _DONE
            self._wake()
            return
        if self._state != _DONE:
            self.fail(UpstreamDisconnected(
                "the worker closed the connection" + (f": {exc}" if exc else "")))


class _Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool, key: tuple):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: a broken worker; do not reuse
            self.close()
            return
        self.response.last_data = time.monotonic()
        try:
            self.response.feed(data)
        except (ValueError, IndexError) as exc:
            self.response.fail(UpstreamDisconnected(f"malformed HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.on_lost(exc)
        self.pool.forget(self)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool.forget(self)


class ConnectionPool:
    def __init__(self, connect_timeout_s: float, request_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.idle: dict[tuple, list[_Connection]] = {}
        self.busy: set[_Connection] = set()
        self._ssl = None

    async def post(self, scheme: str, host: str, port: int, path: str, body: bytes,
                   extra_headers: bytes = b"") -> UpstreamResponse:
        """Sends the request; returns once the status line and headers are in."""
        response = await self.send(scheme, host, port, path, body, extra_headers)
        await response.wait_head()
        return response

    def send_nowait(self, scheme: str, host: str, port: int, path: str, body: bytes,
                    extra_headers: bytes = b"") -> UpstreamResponse | None:
        """Writes the request on an idle pooled connection, without waiting: the answer comes
        into the returned response. None when no idle connection is left (see `send`)."""
        conn = self._take_idle((scheme, host, port))
        return None if conn is None else self._write(conn, path, body, extra_headers)

    async def send(self, scheme: str, host: str, port: int, path: str, body: bytes,
                   extra_headers: bytes = b"") -> UpstreamResponse:
        """Like `send_nowait`, opening a new connection when no idle one is left."""
        key = (scheme, host, port)
        conn = self._take_idle(key) or await self._connect(key)
        return self._write(conn, path, body, extra_headers)

    def _write(self, conn: _Connection, path: str, body: bytes,
               extra_headers: bytes) -> UpstreamResponse:
        response = UpstreamResponse(conn)
        conn.response = response
        self.busy.add(conn)
        response._timer = asyncio.get_running_loop().call_later(
            self.request_timeout_s, self._expire, response)
        host, port = conn.key[1], conn.key[2]
        conn.transport.write(  # head and body in one write: one send() per request
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n%s"
            % (path.encode(), host.encode(), port, len(body), extra_headers, body))
        return response

    def _expire(self, response: UpstreamResponse) -> None:
        response._timer = None
        response.fail(UpstreamTimeout(
            f"no complete answer within {self.request_timeout_s:g} s"))
        response._conn.close()

    def _take_idle(self, key: tuple) -> _Connection | None:
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TIMEOUT_S:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        conn = _Connection(self, key)
        ssl = None
        if scheme == "https":
            ssl = self._ssl = self._ssl or ssl_module.create_default_context()
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: conn, host, port, ssl=ssl),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamConnectError(
                f"connect to {host}:{port} timed out after {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def put_back(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        conn.response = None
        if conn.closed:
            return
        conn.idle_since = time.monotonic()
        self.idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for conn in [*self.busy, *(c for conns in self.idle.values() for c in conns)]:
            conn.close()
        self.idle.clear()
        self.busy.clear()
