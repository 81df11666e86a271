"""Decode's PD queues: prealloc -> transfer -> running, and retracted (SPEC section 4).

Lifecycle of one request on a decode rank:

    add()        PREALLOC   waiting for the prefill topology (bootstrap) and for free pages.
                            Retracted requests (the engine's waiting queue) resume first: while
                            any wait, nothing new is preallocated.
    tick()  ->   TRANSFER   pages for the prompt allocated; the receiver expects the room;
                            KVRequest(room, pages) sent to prefill rank room % prefill slots.
                            States WaitingForInput -> Transferring -> Success, each phase timed.
    tick()  ->   RUNNING    Success: the first token (from the trailer) and the pages join the
                            engine's running batch (`EngineCore.adopt`); decoding continues.
    retracted               the engine retracts running requests when KV runs short and
                            prefills them again locally, ahead of new arrivals.

Failure (a phase timeout, prefill's KVStatus, an unreachable or incompatible prefill, a
client abort) fails the request with a message naming the phase, cancels the room in the
receiver, tells prefill (KVAbort) and moves its pages to RELEASING, where they stay until the
receiver says no write can still reach them; only then are they freed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.engine import EngineCore
from common.engine.request import Req
from common.loads.snapshot import LoadSnapshot
from common.messages.detokenizer_input import TokenDelta
from common.messages.kv_bootstrap import KVAbort, KVRequest, KVStatus
from common.messages.sampling import FinishReason, TopLogprobs
from common.messages.scheduler_input import GenerateRequest
from common.transfer.base import KVPoll, KVReceiver, TransferState
from decode.prefill_directory import PeerState, PrefillDirectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeTimeouts:
    bootstrap: float = 300.0  # topology + pages + sending the indices
    waiting_for_input: float = 300.0  # indices sent, no KV byte yet
    transferring: float = 300.0  # KV arriving


@dataclass(eq=False)
class _Entry:
    req: Req
    room: int
    host: str
    port: int
    since: float  # when the current phase began
    peer: str = ""  # the prefill rank's control endpoint, once known
    prefill_rank: int = -1
    transfer_started: float | None = None
    pages: list[int] = field(default_factory=list)
    transfer: TransferState | None = None


class DecodeQueues:
    def __init__(
        self,
        engine: EngineCore,
        receiver: KVReceiver,
        directory: PrefillDirectory,
        send_control: Callable[[str, object], bool],
        notify_endpoint: str,
        timeouts: DecodeTimeouts = DecodeTimeouts(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        self.allocator = engine.pool.allocator
        self.receiver = receiver
        self.directory = directory
        self.send_control = send_control
        self.notify_endpoint = notify_endpoint
        self.timeouts = timeouts
        self.clock = clock
        self.prealloc: deque[_Entry] = deque()
        self.transfer: dict[int, _Entry] = {}
        self.releasing: list[_Entry] = []
        self._by_rid: dict[str, _Entry] = {}

    # ---- requests -----------------------------------------------------------------------
    def add(self, msg: GenerateRequest) -> list[TokenDelta]:
        missing = [name for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
                   if getattr(msg, name) is None]
        req = Req(rid=msg.rid, prompt_ids=list(msg.input_ids), sampling=msg.sampling,
                  stream=msg.stream, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num)
        if missing:
            return [self._refuse(req, f"decode needs {', '.join(missing)} (send requests "
                                      "through the router)", 400, missing[0])]
        if msg.rid in self._by_rid or msg.rid in self.engine.reqs:
            return [self._refuse(req, f"rid {msg.rid!r} is already in flight", 409, "rid")]
        if self._room_in_flight(msg.bootstrap_room):
            return [self._refuse(req, f"bootstrap_room {msg.bootstrap_room} is already in "
                                      "flight", 409, "bootstrap_room")]
        entry = _Entry(req, msg.bootstrap_room, msg.bootstrap_host, msg.bootstrap_port,
                       self.clock())
        self.directory.lookup(entry.host, entry.port)
        self.prealloc.append(entry)
        self._by_rid[msg.rid] = entry
        return []

    def abort(self, rid: str, message: str) -> list[TokenDelta]:
        entry = self._by_rid.get(rid)
        if entry is None:
            return self.engine.abort(rid, message)
        return [self._fail(entry, message, None)]

    def on_status(self, status: KVStatus) -> list[TokenDelta]:
        entry = self.transfer.get(status.room)
        if entry is None or not status.failed:
            return []
        return [self._fail(entry, f"prefill failed the request: {status.message}", 502,
                           tell_prefill=False)]

    # ---- progress -----------------------------------------------------------------------
    def tick(self) -> list[TokenDelta]:
        deltas = self._advance_transfers()
        deltas += self._advance_prealloc()
        self._release_quiescent()
        return deltas

    def _advance_transfers(self) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        now = self.clock()
        for entry in list(self.transfer.values()):
            state = self.receiver.poll(entry.room)
            if state is KVPoll.Success:
                deltas += self._adopt(entry)
            elif state is KVPoll.Failed:
                deltas.append(self._fail(entry, f"KV transfer failed in phase transferring: "
                                                f"{entry.transfer.reason}", 502))
            elif state is KVPoll.Transferring:
                if entry.transfer_started is None:
                    entry.transfer_started = now
                if now - entry.transfer_started > self.timeouts.transferring:
                    deltas.append(self._fail(
                        entry, f"KV transfer timed out in phase transferring after "
                               f"{self.timeouts.transferring:g}s", 504))
            elif now - entry.since > self.timeouts.waiting_for_input:
                deltas.append(self._fail(
                    entry, f"timed out in phase waiting_for_input after "
                           f"{self.timeouts.waiting_for_input:g}s: prefill rank "
                           f"{entry.prefill_rank} at {entry.host}:{entry.port} sent no KV for "
                           f"bootstrap_room {entry.room} (did the prefill request fail, or "
                           "reach another prefill rank?)", 504))
            else:
                peer = self.directory.lookup(entry.host, entry.port)
                if peer.state is PeerState.DEAD:
                    deltas.append(self._fail(entry, f"phase waiting_for_input: {peer.error}",
                                             503))
        return deltas

    def _advance_prealloc(self) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        now = self.clock()
        blocked = bool(self.engine.scheduler.waiting)  # retracted requests resume first
        for entry in list(self.prealloc):
            peer = self.directory.lookup(entry.host, entry.port)
            if peer.state in (PeerState.DEAD, PeerState.INCOMPATIBLE):
                deltas.append(self._fail(entry, f"phase bootstrap: {peer.error}", 503))
                continue
            if now - entry.since > self.timeouts.bootstrap:
                why = peer.error or "no free KV pages on decode"
                deltas.append(self._fail(
                    entry, f"timed out in phase bootstrap after {self.timeouts.bootstrap:g}s "
                           f"({why})", 504))
                continue
            if peer.state is not PeerState.READY or blocked:
                continue
            topology = peer.topology
            rank = entry.room % topology.num_dp_slots
            reg = topology.ranks.get(rank)
            if reg is None:
                # The topology is only served once every started rank registered: a missing
                # one is a reserved slot or a dead rank, which would never answer.
                deltas.append(self._fail(
                    entry, f"phase bootstrap: prefill rank {rank} (bootstrap_room {entry.room} "
                           f"% {topology.num_dp_slots} slots) at {peer.address} is not serving",
                    503))
                continue
            need = self.engine.pool.pages_for(len(entry.req.prompt_ids))
            running = len(self.engine.scheduler.running) + len(self.transfer)
            if (running >= self.engine.args.max_running_requests
                    or not self.allocator.can_alloc(need + running)):
                blocked = True  # keep arrival order: nothing behind it jumps the queue
                continue
            entry.pages = self.allocator.alloc(need)
            entry.prefill_rank, entry.peer = rank, reg.control_endpoint
            self.prealloc.remove(entry)
            entry.transfer = self.receiver.expect(entry.room, entry.pages)
            sent = self.send_control(reg.control_endpoint, KVRequest(
                room=entry.room,
                decode_rank=self.engine.dp_rank,
                notify_endpoint=self.notify_endpoint,
                kv_endpoint=self.receiver.endpoint_for(reg.control_endpoint),
                dst_pages=entry.pages,
                prompt_len=len(entry.req.prompt_ids),
                prefill_dp_rank=rank,
            ))
            self.transfer[entry.room] = entry
            entry.since = self.clock()
            if not sent:
                deltas.append(self._fail(entry, f"phase bootstrap: cannot reach prefill rank "
                                                f"{rank} at {reg.control_endpoint}", 503,
                                         tell_prefill=False))
        return deltas

    def _adopt(self, entry: _Entry) -> list[TokenDelta]:
        trailer = self.receiver.trailer(entry.room)
        self.receiver.forget(entry.room)
        del self.transfer[entry.room]
        del self._by_rid[entry.req.rid]
        req = entry.req
        req.pages = entry.pages
        req.output_ids.append(trailer.first_token)
        if req.return_logprob:
            req.output_logprobs.append(trailer.logprob if trailer.logprob is not None
                                       else float("nan"))
            req.output_top_logprobs.append(trailer.top_logprobs or TopLogprobs([], []))
        return self.engine.adopt(req)

    def _release_quiescent(self) -> None:
        still = []
        for entry in self.releasing:
            if self.receiver.pages_quiescent(entry.room):
                self.receiver.forget(entry.room)
                self.allocator.free(entry.pages)
            else:
                still.append(entry)
        self.releasing = still

    # ---- failure ------------------------------------------------------------------------
    def _fail(self, entry: _Entry, message: str, status: int | None,
              tell_prefill: bool = True) -> TokenDelta:
        self._by_rid.pop(entry.req.rid, None)
        if entry in self.prealloc:
            self.prealloc.remove(entry)
        if self.transfer.get(entry.room) is entry:
            del self.transfer[entry.room]
            self.receiver.cancel(entry.room, message)
            if tell_prefill:
                self.send_control(entry.peer, KVAbort(room=entry.room, reason=message))
        if entry.pages:
            self.releasing.append(entry)
        if status is not None:
            logger.warning("request %s (room %d): %s", entry.req.rid, entry.room, message)
        return self._refuse(entry.req, message, status)

    def _refuse(self, req: Req, message: str, status: int | None,
                param: str | None = None) -> TokenDelta:
        req.finish_reason = FinishReason(type="abort", message=message, status=status,
                                         param=param)
        return self.engine.delta(req)

    def _room_in_flight(self, room: int) -> bool:
        return room in self.transfer or any(e.room == room for e in self.prealloc)

    # ---- accounting ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def waiting_on_io(self) -> bool:
        return bool(self.prealloc or self.transfer or self.releasing)

    def queue_counts(self) -> tuple[int, ...]:
        return (len(self.prealloc), len(self.transfer), len(self.releasing))

    def load_snapshot(self) -> LoadSnapshot:
        base = self.engine.load_snapshot()
        page = self.engine.pool.page_size
        in_flight = sum(len(e.pages) for e in self.transfer.values()) * page
        to_come = sum(self.engine.pool.pages_for(len(e.req.prompt_ids))
                      for e in self.prealloc) * page
        retracted = len(self.engine.scheduler.waiting)
        total = base.num_total_tokens + to_come
        return LoadSnapshot(
            dp_rank=base.dp_rank,
            timestamp=base.timestamp,
            num_running_reqs=base.num_running_reqs,
            num_waiting_reqs=len(self.prealloc) + len(self.transfer) + retracted,
            num_used_tokens=base.num_used_tokens,
            num_total_tokens=total,
            num_active_tokens=total - in_flight - to_come,
            max_total_num_tokens=base.max_total_num_tokens,
            token_usage=base.token_usage,
            num_prealloc_reqs=len(self.prealloc),
            num_transfer_reqs=len(self.transfer),
            num_retracted_reqs=retracted,
        )
