"""The KV transfer interface shared by every backend, and page-run coalescing.

Per-request transfer states (SPEC section 4), monotonic, Failed sticky:

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\________________\\_______________\\_______> Failed

A backend moves, for one request, the KV of `src_pages` in the sender's pool into `dst_pages`
of the receiver's pool, for every layer, K and V. Pages are the pool's unit
(`common/engine/kv_pool.py`): consecutive page ids are one contiguous block per layer, so a
transfer is described as *runs* contiguous on both sides (`contiguous_runs`), never as single
pages: per-page entries cost up to 3x (see shared/TRANSFER.md).

Every backend offers the same two objects (`KVReceiver` on decode, `KVSender` on prefill);
`common/transfer/registry.py` picks them by `--disaggregation-transfer-backend`. A receiver
never lets bytes reach pages of a room it has cancelled: once `cancel(room)` returned and
`pages_quiescent(room)` is true, decode may give the pages to another request.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from common.messages.sampling import TopLogprobs


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferState:
    """A monotonic KVPoll holder: states only move forward; Failed is sticky.

    On the sending side, `fail` may also come from the owner (a timeout, an abort) while the
    backend is still reading the source pages; `pages_released` is what says the backend is
    done with them (set once, by the backend, after Success or Failed), and only then may the
    pages be freed."""

    def __init__(self) -> None:
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.pages_released = False

    def advance(self, state: KVPoll) -> None:
        if self.state is KVPoll.Failed or self.state is KVPoll.Success:
            return
        if state is KVPoll.Failed or state > self.state:
            self.state = state

    def fail(self, reason: str) -> None:
        if self.state is not KVPoll.Failed and self.state is not KVPoll.Success:
            self.reason = reason
            self.state = KVPoll.Failed


class PageRun(msgspec.Struct, array_like=True, frozen=True):
    """`length` pages from `src` in the sender's pool to `dst` in the receiver's."""

    src: int
    dst: int
    length: int


def contiguous_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Group page pairs into runs that are consecutive on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    i = 0
    while i < len(src_pages):
        j = i + 1
        while (
            j < len(src_pages)
            and src_pages[j] == src_pages[j - 1] + 1
            and dst_pages[j] == dst_pages[j - 1] + 1
        ):
            j += 1
        runs.append(PageRun(src_pages[i], dst_pages[i], j - i))
        i = j
    return runs


class TransferTrailer(msgspec.Struct, kw_only=True, frozen=True):
    """What decode needs besides the KV: the first output token and its logprob."""

    first_token: int
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What both sides must agree on before any byte moves."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def check_compatible(self, other: KVLayout) -> None:
        for field in ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                raise ValueError(f"KV layout mismatch: {field} is {mine} here, {theirs} on the peer")


@dataclass
class ExpectedRoom:
    """A receiver's record of one room: where its KV goes and how far it got."""

    dst_pages: list[int]
    state: TransferState
    trailer: TransferTrailer | None = None
    busy: bool = False  # bytes may be landing in the pages right now
    handle: object | None = None  # what `cancel` interrupts while busy (tcp: the socket)


class ExpectedRooms:
    """The decode-side bookkeeping every receiver shares: rooms are expected with their
    destination pages, delivered (trailer + Success) or cancelled, then forgotten. Backends
    flip `busy` around the moment bytes land in the pages, under `self._lock`, and override
    `_interrupt` to cut a delivery in progress when its room is cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: dict[int, ExpectedRoom] = {}

    def expect(self, room: int, dst_pages: Sequence[int]) -> TransferState:
        with self._lock:
            if room in self._expected:
                raise ValueError(f"bootstrap_room {room} is already expected")
            record = ExpectedRoom(list(dst_pages), TransferState())
            record.state.advance(KVPoll.WaitingForInput)
            self._expected[room] = record
            return record.state

    def poll(self, room: int) -> KVPoll:
        record = self._expected.get(room)
        return KVPoll.Failed if record is None else record.state.state

    def trailer(self, room: int) -> TransferTrailer | None:
        record = self._expected.get(room)
        return None if record is None else record.trailer

    def cancel(self, room: int, reason: str) -> None:
        """Fail the room; a delivery still writing into its pages is interrupted, so the pages
        are quiescent as soon as it notices (a refused late sender never writes)."""
        with self._lock:
            record = self._expected.get(room)
            if record is None:
                return
            record.state.fail(reason)
            if record.busy:
                self._interrupt(record)

    def pages_quiescent(self, room: int) -> bool:
        """False while a delivery may still write into this room's pages."""
        record = self._expected.get(room)
        return record is None or not record.busy

    def forget(self, room: int) -> None:
        with self._lock:
            self._expected.pop(room, None)

    def _interrupt(self, record: ExpectedRoom) -> None:
        pass


class KVReceiver(Protocol):
    """Decode side: one per KV pool."""

    def endpoint_for(self, peer: str) -> str:
        """The address a given prefill rank (named by its control endpoint) sends KV to."""

    def expect(self, room: int, dst_pages: Sequence[int]) -> TransferState: ...

    def poll(self, room: int) -> KVPoll: ...

    def trailer(self, room: int) -> TransferTrailer | None: ...

    def cancel(self, room: int, reason: str) -> None: ...

    def pages_quiescent(self, room: int) -> bool: ...

    def forget(self, room: int) -> None: ...

    def close(self) -> None: ...


class KVSender(Protocol):
    """Prefill side: one per KV pool. `send` returns at once; the source pages must stay
    untouched until the returned state is Success or Failed."""

    def send(self, endpoint: str, room: int, src_pages: Sequence[int],
             dst_pages: Sequence[int], trailer: TransferTrailer) -> TransferState: ...

    def close(self) -> None: ...
