"""Multipart messages over a Unix stream socket: the front end -> DP controller channel.

Why not ZMQ here (every other channel in a service tree is ZMQ): a ZMQ socket does its socket
I/O on a background I/O thread, so a message that crosses a relay process wakes that process
three times (its I/O thread on arrival, its Python thread, its I/O thread again for the send).
On small shared VMs each wakeup of an idle thread costs tens of microseconds, and the controller
is a pure relay hop on every request's path. Reading its input straight from a kernel socket in
its own thread removes one wakeup in the controller and one in the front end (whose event loop
writes to the kernel itself); `benchmarks/bench_dispatch.py` measures both side by side. The
controller's outputs stay ZMQ PUSH sockets, one per scheduler, as the contract says.

Wire format, per message (little-endian):

    u32 length of the rest | u32 frame count n | u32 frame length x n | frame bytes x n

A message is at most MAX_MESSAGE_BYTES (sender and reader agree); `encode_message` refuses a
larger one with ValueError, so the caller can answer that request alone with an error.

Senders:
- `AsyncFrameSender` (the front end, in its asyncio loop): never blocks the loop; a write the
  kernel cannot take whole is finished by a loop writer callback, and later messages queue
  behind it, so order is kept.
- `send_blocking` (tests, benchmarks): a blocking socket.

Receiver: `FrameReader` turns one connection's byte stream into messages (lists of memoryviews
into its buffer). The views are valid only until its next `read()`: consume (decode or copy)
them before reading again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_COUNT = struct.Struct("<I")
# The two shapes on the hot path (a control message; one request: header + body).
_HEAD_ONE = struct.Struct("<III")
_HEAD_TWO = struct.Struct("<IIII")
_TWO_LENGTHS = struct.Struct("<II")
MAX_MESSAGE_BYTES = 1 << 31  # a longer length prefix means a corrupt stream
# sendmsg takes at most IOV_MAX (1,024 on Linux) buffers: many-frame messages are joined first.
_MAX_IOV = 64
_INITIAL_BUFFER = 256 * 1024


class FrameStreamError(Exception):
    """The byte stream does not parse: the connection cannot be resynchronised."""


def encode_message(frames: Sequence[bytes]) -> list[bytes]:
    """The buffers that make up one message on the wire (for `sendmsg`). Frames are bytes-like
    objects of bytes (their len() is their size in bytes)."""
    n = len(frames)
    if n == 2:
        a, b = frames
        size = 12 + len(a) + len(b)
        if size <= MAX_MESSAGE_BYTES:
            return [_HEAD_TWO.pack(size, 2, len(a), len(b)), a, b]
    elif n == 1:
        a = frames[0]
        size = 8 + len(a)
        if size <= MAX_MESSAGE_BYTES:
            return [_HEAD_ONE.pack(size, 1, len(a)), a]
    if n == 0:
        raise ValueError("a message has at least one frame")
    lengths = [len(f) for f in frames]
    size = 4 + 4 * n + sum(lengths)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size:,} bytes is over the channel's limit of "
                         f"{MAX_MESSAGE_BYTES:,}")
    head = struct.pack(f"<II{n}I", size, n, *lengths)
    if n + 1 > _MAX_IOV:
        return [b"".join((head, *frames))]
    return [head, *frames]


def listen(path: str) -> socket.socket:
    """A listening socket at `path` (a stale file left by a dead process is replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    return sock


def connect(path: str, blocking: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.setblocking(blocking)
    return sock


def send_blocking(sock: socket.socket, frames: Sequence[bytes]) -> None:
    sock.sendall(b"".join(encode_message(frames)))


class AsyncFrameSender:
    """The front end's end of the channel. `send` returns at once: what the kernel does not
    take now is written by a loop writer as the peer reads, in order. A broken connection
    (the controller died) calls `on_broken` once and makes `send` raise ConnectionError from
    then on; the service's supervisor also notices the dead process and stops the service."""

    def __init__(self, path: str, on_broken: Callable[[str], None] | None = None):
        self.path = path
        # Called once, with the reason, when the connection breaks: queued messages are lost.
        self.on_broken = on_broken
        self.sock = connect(path, blocking=False)
        self._backlog: deque[memoryview] = deque()  # never holds an empty buffer
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: OSError | None = None
        self.closed = False

    @property
    def backlog_bytes(self) -> int:
        return sum(len(b) for b in self._backlog)

    def send(self, frames: Sequence[bytes]) -> None:
        """Raises ValueError for a message over MAX_MESSAGE_BYTES (nothing is sent), and
        ConnectionError once the channel is broken or closed."""
        if self.error is not None or self.closed:
            raise ConnectionError(f"DP controller channel is closed: {self.error or 'closed'}")
        bufs = encode_message(frames)
        if self._backlog:
            self._backlog.extend(memoryview(b) for b in bufs if len(b))
            return
        try:
            sent = self.sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._broken(exc)
            raise ConnectionError(f"DP controller channel is closed: {exc}") from None
        if sent != 4 + _LENGTH.unpack_from(bufs[0])[0]:  # the first buffer holds the length
            self._queue_rest(bufs, sent)

    def _queue_rest(self, bufs: list[bytes], sent: int) -> None:
        loop = asyncio.get_running_loop()  # before queueing: no backlog without a writer
        for buf in bufs:
            if sent >= len(buf):
                sent -= len(buf)
                continue
            self._backlog.append(memoryview(buf)[sent:])
            sent = 0
        self._loop = loop
        loop.add_writer(self.sock.fileno(), self._flush)

    def _flush(self) -> None:
        backlog = self._backlog
        while backlog:
            chunk = [backlog[i] for i in range(min(len(backlog), _MAX_IOV))]
            try:
                sent = self.sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._broken(exc)
                return
            while sent:
                head = backlog[0]
                if sent >= len(head):
                    sent -= len(head)
                    backlog.popleft()
                else:
                    backlog[0] = head[sent:]
                    sent = 0
        self._stop_writer()

    def _broken(self, exc: OSError) -> None:
        logger.error("lost the DP controller channel (%s): %s", self.path, exc)
        self.error = exc
        self._backlog.clear()
        self._stop_writer()
        if self.on_broken is not None:
            self.on_broken(f"DP controller channel is closed: {exc}")

    def _stop_writer(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self.sock.fileno())
            self._loop = None

    def close(self) -> None:
        self.closed = True
        self._stop_writer()
        self._backlog.clear()
        self.sock.close()


class FrameReader:
    """Parses one connection's stream into messages. `read()` does one recv (the socket is
    non-blocking: call it when poll says readable) and returns the messages completed by it;
    None once the peer has closed the connection. Raises FrameStreamError on a corrupt stream."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setblocking(False)
        self._buf = bytearray(_INITIAL_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # first byte not yet parsed
        self._end = 0  # end of the bytes received

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[list[memoryview]] | None:
        self._make_room()
        try:
            n = self.sock.recv_into(self._view[self._end:])
        except (BlockingIOError, InterruptedError):
            return []
        except ConnectionResetError:
            return None
        if n == 0:
            return None
        self._end += n
        return self._parse()

    def _make_room(self) -> None:
        """Before a read: start again at offset 0 when everything was parsed; move a partial
        message to the front, or into a larger buffer when it cannot fit."""
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = 0
            if len(self._buf) > 4 * _INITIAL_BUFFER:  # give back what a huge message took
                self._buf = bytearray(_INITIAL_BUFFER)
                self._view = memoryview(self._buf)
            return
        needed = end - start
        if end - start >= 4:
            needed = max(needed, 4 + _LENGTH.unpack_from(self._buf, start)[0])
        if needed > len(self._buf):
            size = max(needed, 2 * len(self._buf))
            self._buf = bytearray(size)  # views handed out earlier keep the old buffer alive
            self._buf[: end - start] = self._view[start:end]
            self._view = memoryview(self._buf)
        elif start > 0 and (end == len(self._buf) or len(self._buf) - end < len(self._buf) // 8):
            self._buf[: end - start] = self._buf[start:end]
        else:
            return
        self._start, self._end = 0, end - start

    def _parse(self) -> list[list[memoryview]]:
        messages = []
        buf, view = self._buf, self._view
        pos, end = self._start, self._end
        while end - pos >= 4:
            (length,) = _LENGTH.unpack_from(buf, pos)
            if length < 4 or length > MAX_MESSAGE_BYTES:
                raise FrameStreamError(f"bad message length {length}")
            if end - pos - 4 < length:
                break
            body = pos + 4
            (count,) = _COUNT.unpack_from(buf, body)
            if count == 0 or 4 + 4 * count > length:
                raise FrameStreamError(f"bad frame count {count} for {length} bytes")
            if count == 2:
                lengths = _TWO_LENGTHS.unpack_from(buf, body + 4)
            else:
                lengths = struct.unpack_from(f"<{count}I", buf, body + 4)
            at = body + 4 + 4 * count
            stop = body + length
            if at + sum(lengths) != stop:
                raise FrameStreamError("frame lengths do not add up to the message length")
            frames = []
            for n in lengths:
                frames.append(view[at:at + n])
                at += n
            messages.append(frames)
            pos = stop
        self._start = pos
        return messages
