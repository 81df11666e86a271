"""`tcp` backend: KV pages over plain TCP sockets, page runs streamed straight from the sender's
pool into the receiver's pool (no intermediate buffer on CPU pools).

Receiver (decode side), one `TcpKVReceiver` per pool:
    expect(room, dst_pages)   register a request: WaitingForInput
    a sender connects         header checked against the registration: Transferring
    bytes arrive              recv_into the destination slices, layer by layer, K then V
    trailer arrives           first output token + logprob: Success (or Failed on any error)
    forget(room)              drop the record once decode has consumed the result

Sender (prefill side), `TcpKVSender.send(...)` queues one transfer on the persistent connection
to that receiver (one link thread per endpoint, transfers in order) and returns its
`TransferState` to poll: Transferring -> Success once the receiver acknowledged, or Failed. A
failed transfer closes the connection; the next one reconnects.

Runs move with scatter/gather socket calls (sendmsg / recvmsg_into over up to 512 slices at a
time), so a transfer of thousands of page slices costs a handful of syscalls and no copies.

Wire format, repeated per transfer on one connection:
    u32 length + msgpack TransferHeader, the raw run bytes, u32 length + msgpack
    TransferTrailer, sent back to back; the receiver answers one byte: 1 delivered, 0 refused
    (an unexpected or cancelled room, a foreign layout: it read and dropped the bytes, no page
    was touched, and the connection carries on).
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from collections.abc import Sequence
import msgspec
import torch

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import (
    ExpectedRoom,
    ExpectedRooms,
    KVLayout,
    KVPoll,
    PageRun,
    TransferState,
    TransferTrailer,
    contiguous_runs,
)

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_HEADER = 64 << 20


class TransferHeader(msgspec.Struct, kw_only=True, frozen=True):
    room: int
    runs: list[PageRun]
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


def pool_layout(pool: PagedKVPool) -> KVLayout:
    _, _, heads, dim = pool.k.shape
    return KVLayout(pool.k.shape[0], pool.page_size, heads, dim, str(pool.k.dtype))


def _run_views(pool: PagedKVPool, runs: Sequence[PageRun], dst: bool) -> list[memoryview]:
    """Byte views of every run's slices, per run, per layer, K then V; each one contiguous.

    Sliced from one memoryview per tensor: building tensor views per slice costs ~30 us each,
    which dominates a transfer of thousands of small pages."""
    k_bytes = memoryview(pool.k.view(-1).view(torch.uint8).numpy())
    v_bytes = memoryview(pool.v.view(-1).view(torch.uint8).numpy())
    num_layers = pool.k.shape[0]
    layer_bytes = len(k_bytes) // num_layers
    page_bytes = layer_bytes // pool.allocator.num_total_pages
    views = []
    for run in runs:
        first = (run.dst if dst else run.src) * page_bytes
        size = run.length * page_bytes
        for layer in range(num_layers):
            start = layer * layer_bytes + first
            views.append(k_bytes[start : start + size])
            views.append(v_bytes[start : start + size])
    return views


IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """Drop the first `done` bytes from a list of buffers."""
    i = 0
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Gathered writes straight from the pool slices: one syscall per IOV_BATCH buffers."""
    while views:
        sent = sock.sendmsg(views[:IOV_BATCH])
        views = _advance(views, sent)


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scattered reads straight into the pool slices."""
    while views:
        # MSG_WAITALL: the kernel fills the whole batch before returning, instead of
        # returning after every segment (each call re-reads the whole iovec array).
        got = sock.recvmsg_into(views[:IOV_BATCH], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        views = _advance(views, got)


def _payload_bytes(header: TransferHeader) -> int:
    """Bytes the sender streams after this header (its own layout, which may not be ours)."""
    try:
        itemsize = getattr(torch, header.dtype.removeprefix("torch.")).itemsize
    except AttributeError:
        raise ValueError(f"unknown dtype {header.dtype!r}") from None
    page = header.page_size * header.num_kv_heads * header.head_dim * itemsize
    return sum(r.length for r in header.runs) * page * header.num_layers * 2


def _drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n:
        got = sock.recv_into(scratch, min(n, len(scratch)))
        if got == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        n -= got


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[got:]


def _send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    payload = msgspec.msgpack.encode(msg)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_msg(sock: socket.socket, type_):
    (length,) = _LEN.unpack(_recv_exact(sock, 4))
    if length > MAX_HEADER:
        raise ValueError(f"message of {length} bytes is too large")
    return msgspec.msgpack.decode(_recv_exact(sock, length), type=type_)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)


class TcpKVReceiver(ExpectedRooms):
    def __init__(self, pool: PagedKVPool, host: str = "127.0.0.1", port: int = 0):
        if pool.k.device.type != "cpu":
            raise ValueError("the tcp backend receives into CPU pools; use the torch backend")
        super().__init__()
        self.pool = pool
        self.layout = pool_layout(pool)
        self._listener = socket.create_server((host, port))
        self.endpoint = "%s:%d" % self._listener.getsockname()[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-recv", daemon=True)
        self._thread.start()

    def endpoint_for(self, peer: str) -> str:
        return self.endpoint  # one listener serves every prefill rank

    def _interrupt(self, record: ExpectedRoom) -> None:
        try:
            record.handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    # ---- connections -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Transfers from one sender, one after the other, until it closes the connection
        (or a transfer fails: the connection ends with it and the sender reconnects)."""
        with conn:
            _tune(conn)
            while not self._closed:
                try:
                    header = _recv_msg(conn, TransferHeader)
                except (OSError, ConnectionError, ValueError, msgspec.DecodeError):
                    return  # the sender closed its persistent connection, or broke
                if not self._receive(conn, header):
                    return

    def _receive(self, conn: socket.socket, header: TransferHeader) -> bool:
        """One transfer; True when the connection can carry the next one. The sender does not
        wait for a go-ahead, so a refused transfer's bytes are read and dropped."""
        record = self._admit(header, conn)
        try:
            if record is None:
                _drain(conn, _payload_bytes(header))
                _recv_msg(conn, TransferTrailer)
                conn.sendall(b"\0")
                return True
            _recv_views(conn, _run_views(self.pool, header.runs, dst=True))
            trailer = _recv_msg(conn, TransferTrailer)
            with self._lock:
                if record.state.state is KVPoll.Transferring:
                    record.trailer = trailer
                    record.state.advance(KVPoll.Success)
            ok = record.state.state is KVPoll.Success
            conn.sendall(b"\1" if ok else b"\0")
            return ok
        except (OSError, ConnectionError, ValueError, msgspec.DecodeError) as exc:
            if record is not None:
                record.state.fail(f"transfer failed: {exc}")
            return False
        finally:
            if record is not None:
                with self._lock:
                    record.busy = False
                    record.handle = None

    def _admit(self, header: TransferHeader, conn: socket.socket) -> ExpectedRoom | None:
        layout = KVLayout(header.num_layers, header.page_size, header.num_kv_heads,
                          header.head_dim, header.dtype)
        with self._lock:
            record = self._expected.get(header.room)
            if record is None or record.state.state is not KVPoll.WaitingForInput:
                return None
            try:
                self.layout.check_compatible(layout)
                pages = {r.dst + i for r in header.runs for i in range(r.length)}
                if not pages <= set(record.dst_pages):
                    raise ValueError("the sender targets pages this room does not own")
            except ValueError as exc:
                record.state.fail(str(exc))
                return None
            record.busy = True
            record.handle = conn
            record.state.advance(KVPoll.Transferring)
            return record


class _Link:
    """One persistent connection to a receiver endpoint and the thread that owns it: transfers
    to that endpoint go out in order; a failure closes the connection and the next transfer
    reconnects."""

    def __init__(self, sender: TcpKVSender, endpoint: str):
        self.sender = sender
        self.endpoint = endpoint
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        threading.Thread(target=self._run, daemon=True, name=f"kv-link-{endpoint}").start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            room, runs, trailer, state = job
            if state.state is KVPoll.Failed:  # given up before its turn came
                state.pages_released = True
                continue
            try:
                if self.sock is None:
                    host, _, port = self.endpoint.rpartition(":")
                    self.sock = socket.create_connection((host, int(port)),
                                                         timeout=self.sender.timeout)
                    _tune(self.sock)
                self.sender._transfer(self.sock, room, runs, trailer)
                state.advance(KVPoll.Success)
            except _Refused as exc:
                state.fail(f"sending KV for room {room} to {self.endpoint} failed: {exc}")
            except (OSError, ConnectionError, ValueError) as exc:
                state.fail(f"sending KV for room {room} to {self.endpoint} failed: {exc}")
                self._close()
            finally:
                state.pages_released = True
        self._close()

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class TcpKVSender:
    def __init__(self, pool: PagedKVPool, timeout: float = 30.0):
        self.pool = pool
        self.layout = pool_layout(pool)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.jobs.put(None)
            self._links.clear()

    def _runs_to_send(self, runs: list[PageRun]) -> list[PageRun]:
        return runs

    def send(
        self,
        endpoint: str,
        room: int,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        trailer: TransferTrailer,
    ) -> TransferState:
        """Queues the transfer on the endpoint's link; poll the returned state. The source
        pages must stay untouched until it reaches Success or Failed."""
        state = TransferState()
        state.advance(KVPoll.Transferring)
        runs = self._runs_to_send(contiguous_runs(src_pages, dst_pages))
        with self._lock:
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = _Link(self, endpoint)
            link.jobs.put((room, runs, trailer, state))
        return state

    def _transfer(self, sock: socket.socket, room: int, runs: list[PageRun],
                  trailer: TransferTrailer) -> None:
        layout = self.layout
        header = TransferHeader(room=room, runs=runs, num_layers=layout.num_layers,
                                page_size=layout.page_size, num_kv_heads=layout.num_kv_heads,
                                head_dim=layout.head_dim, dtype=layout.dtype)
        # One round trip per transfer: header, bytes and trailer go out back to back, and the
        # receiver answers once (1: delivered, 0: refused, its bytes dropped).
        _send_msg(sock, header)
        _send_views(sock, _run_views(self.pool, runs, dst=False))
        _send_msg(sock, trailer)
        if _recv_exact(sock, 1) != b"\1":
            raise _Refused(f"the receiver refused bootstrap_room {room}")


class _Refused(ConnectionError):
    """The receiver declined one transfer; the connection itself is fine."""


class FakeKVSender(TcpKVSender):
    """`fake` backend: the tcp handshake and trailer without a single KV byte, so decode runs
    on whatever its pages hold. For warm-up and for benchmarks of everything but the copy."""

    def _runs_to_send(self, runs: list[PageRun]) -> list[PageRun]:
        return []
