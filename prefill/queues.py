"""Prefill's PD queues: bootstrap -> forward -> inflight -> release (SPEC section 4).

Lifecycle of one request on a prefill rank:

    add()          BOOTSTRAP  the request is here but decode's page indices are not: it waits
                              (no compute before decode has preallocated: back-pressure).
                              A KVRequest may also arrive first; it waits in `early`.
    KVRequest  ->  FORWARD    both halves met: the request enters the engine's waiting queue
                              and is prefilled like any other.
    on_prefilled  INFLIGHT    the first token is sampled; the request leaves the batch with its
                              pages held, and the sender writes the pages plus the first token
                              (and its logprobs) into decode's pages.
    tick()     ->  released   Success: pages freed, the client gets the first token. Failed
                              (or timed out, or aborted): the client gets an error naming the
                              phase and decode is told (KVStatus) at once, but the pages are
                              freed only once the sender has let go of them
                              (`TransferState.pages_released`).

Checks that turn a mis-set deployment into a clear error instead of a hang: a request without
`bootstrap_room`; a room whose `room % slots` is not this rank (the prefill controller is not
following the room); a KVRequest computed for another rank, or for a prompt of another length.
Every wait is bounded: bootstrap (and an early KVRequest) by the bootstrap timeout, inflight
by the transfer timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.engine import EngineCore
from common.engine.request import Req
from common.loads.snapshot import LoadSnapshot
from common.messages.detokenizer_input import TokenDelta
from common.messages.kv_bootstrap import KVAbort, KVRequest, KVStatus
from common.messages.sampling import FinishReason, TopLogprobs
from common.messages.scheduler_input import GenerateRequest
from common.transfer.base import KVPoll, KVSender, TransferState, TransferTrailer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillTimeouts:
    bootstrap: float = 300.0  # waiting for decode's page indices
    transferring: float = 300.0  # KV being sent


@dataclass(eq=False)
class _Entry:
    msg: GenerateRequest
    room: int
    since: float
    kv: KVRequest | None = None
    req: Req | None = None  # the engine's request, from on_prefilled on
    transfer: TransferState | None = None
    client_gone: bool = False  # answered already (abort); pages still wait for the sender


class PrefillQueues:
    def __init__(
        self,
        engine: EngineCore,
        sender: KVSender,
        send_control: Callable[[str, object], bool],
        num_dp_slots: int,
        timeouts: PrefillTimeouts = PrefillTimeouts(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        self.allocator = engine.pool.allocator
        self.sender = sender
        self.send_control = send_control
        self.num_dp_slots = num_dp_slots
        self.timeouts = timeouts
        self.clock = clock
        self.bootstrap: dict[int, _Entry] = {}
        self.early: dict[int, tuple[KVRequest, float]] = {}
        self.forward: dict[int, _Entry] = {}
        self.inflight: dict[int, _Entry] = {}
        self._by_rid: dict[str, _Entry] = {}
        engine.on_prefilled = self._on_prefilled

    @property
    def rank(self) -> int:
        return self.engine.dp_rank

    # ---- requests from the front end ----------------------------------------------------
    def add(self, msg: GenerateRequest) -> list[TokenDelta]:
        room = msg.bootstrap_room
        if room is None:
            return [self._refuse(msg, "prefill needs bootstrap_room (send requests through the "
                                      "router)", 400, "bootstrap_room")]
        if msg.rid in self._by_rid or msg.rid in self.engine.reqs:
            return [self._refuse(msg, f"rid {msg.rid!r} is already in flight", 409, "rid")]
        if self._entry_for_room(room) is not None:
            return [self._refuse(msg, f"bootstrap_room {room} is already in flight", 409,
                                 "bootstrap_room")]
        owner = room % self.num_dp_slots
        if owner != self.rank:
            message = (f"bootstrap_room {room} reached prefill rank {self.rank}, but room % "
                       f"{self.num_dp_slots} slots = {owner}: the prefill DP controller must "
                       "dispatch with follow_bootstrap_room (and routed_dp_rank must agree)")
            early = self.early.pop(room, None)
            if early is not None:
                self._tell_decode(early[0], message)
            return [self._refuse(msg, message, 503)]
        entry = _Entry(msg, room, self.clock())
        self._by_rid[msg.rid] = entry
        early = self.early.pop(room, None)
        if early is None:
            self.bootstrap[room] = entry
            return []
        return self._meet(entry, early[0])

    def abort(self, rid: str, message: str) -> list[TokenDelta]:
        entry = self._by_rid.get(rid)
        if entry is None:
            return self.engine.abort(rid, message)
        return self._fail(entry, message, None, tell_decode=True)

    # ---- control messages from decode ---------------------------------------------------
    def on_kv_request(self, kv: KVRequest) -> list[TokenDelta]:
        room = kv.room
        if room % self.num_dp_slots != self.rank or kv.prefill_dp_rank != self.rank:
            self._tell_decode(kv, f"rooms disagree: decode sent bootstrap_room {room} to "
                                  f"prefill rank {self.rank} (it computed rank "
                                  f"{kv.prefill_dp_rank}), but {room} % {self.num_dp_slots} "
                                  f"= {room % self.num_dp_slots}")
            return []
        entry = self.bootstrap.pop(room, None)
        if entry is not None:
            return self._meet(entry, kv)
        if room in self.forward or room in self.inflight or room in self.early:
            self._tell_decode(kv, f"bootstrap_room {room} already has a decode destination")
            return []
        self.early[room] = (kv, self.clock())
        return []

    def on_kv_abort(self, abort: KVAbort) -> list[TokenDelta]:
        self.early.pop(abort.room, None)
        entry = self._entry_for_room(abort.room)
        if entry is None:
            return []
        return self._fail(entry, f"decode gave up on the request: {abort.reason}", 502,
                          tell_decode=False)

    def _meet(self, entry: _Entry, kv: KVRequest) -> list[TokenDelta]:
        prompt_len = len(entry.msg.input_ids)
        need = self.engine.pool.pages_for(prompt_len)
        if kv.prompt_len != prompt_len or len(kv.dst_pages) != need:
            message = (f"bootstrap_room {entry.room}: decode holds a {kv.prompt_len}-token "
                       f"prompt in {len(kv.dst_pages)} pages, prefill a {prompt_len}-token "
                       "prompt: the two sides got different requests for one room")
            entry.kv = kv
            return self._fail(entry, message, 409, tell_decode=True)
        entry.kv = kv
        entry.since = self.clock()
        self.forward[entry.room] = entry
        return self.engine.add(entry.msg)

    # ---- the engine hands over a prefilled request --------------------------------------
    def _on_prefilled(self, req: Req, token: int, logprob: float | None,
                      top: TopLogprobs | None) -> None:
        entry = self._by_rid.get(req.rid)
        if entry is None or self.forward.get(entry.room) is not entry:
            self.allocator.free(req.pages)  # aborted meanwhile
            req.pages = []
            return
        del self.forward[entry.room]
        entry.req = req
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top or TopLogprobs([], []))
        kv = entry.kv
        entry.transfer = self.sender.send(
            kv.kv_endpoint, entry.room, req.pages[: len(kv.dst_pages)], kv.dst_pages,
            TransferTrailer(first_token=token, logprob=logprob, top_logprobs=top),
        )
        entry.since = self.clock()
        self.inflight[entry.room] = entry

    # ---- progress -----------------------------------------------------------------------
    def tick(self) -> list[TokenDelta]:
        deltas: list[TokenDelta] = []
        now = self.clock()
        for entry in list(self.inflight.values()):
            transfer = entry.transfer
            if transfer.pages_released:  # the sender is done with the pages
                failure = None if transfer.state is KVPoll.Success else (
                    f"KV transfer failed in phase transferring: {transfer.reason}")
                deltas += self._release(entry, failure)
            elif now - entry.since > self.timeouts.transferring and not entry.client_gone:
                # Answer and tell decode now; the pages wait until the sender lets go.
                deltas += self._fail(entry, f"timed out in phase transferring after "
                                            f"{self.timeouts.transferring:g}s", 504,
                                     tell_decode=True)
        for entry in list(self.bootstrap.values()):
            if now - entry.since > self.timeouts.bootstrap:
                deltas += self._fail(entry, f"timed out in phase bootstrap after "
                                            f"{self.timeouts.bootstrap:g}s: decode never sent "
                                            f"the page indices for bootstrap_room {entry.room}",
                                     504, tell_decode=False)
        for room, (kv, arrived) in list(self.early.items()):
            if now - arrived > self.timeouts.bootstrap:
                del self.early[room]
                self._tell_decode(kv, f"prefill rank {self.rank} never received the request "
                                      f"for bootstrap_room {room}")
        return deltas

    def _release(self, entry: _Entry, failure: str | None) -> list[TokenDelta]:
        """The sender is done with the pages (Success or Failed): free them and answer."""
        del self.inflight[entry.room]
        self._by_rid.pop(entry.msg.rid, None)
        req = entry.req
        self.allocator.free(req.pages)
        req.pages = []
        if entry.client_gone:
            return []
        if failure is not None:
            self._tell_decode(entry.kv, failure)
            logger.warning("request %s (room %d): %s", req.rid, entry.room, failure)
            req.finish_reason = FinishReason(type="abort", message=failure, status=502)
        else:
            req.finish_reason = FinishReason(type="length", length=len(req.output_ids))
        return [self.engine.delta(req)]

    # ---- failure ------------------------------------------------------------------------
    def _fail(self, entry: _Entry, message: str, status: int | None,
              tell_decode: bool) -> list[TokenDelta]:
        room = entry.room
        if tell_decode and entry.kv is not None:
            self._tell_decode(entry.kv, message)
        if status is not None:
            logger.warning("request %s (room %d): %s", entry.msg.rid, room, message)
        if self.inflight.get(room) is entry:
            # The sender may still read the pages: answer now, free them in tick().
            if entry.client_gone:
                return []
            entry.client_gone = True
            entry.transfer.fail(message)
            req = entry.req
            req.finish_reason = FinishReason(type="abort", message=message, status=status)
            return [self.engine.delta(req)]
        self._by_rid.pop(entry.msg.rid, None)
        self.bootstrap.pop(room, None)
        if self.forward.pop(room, None) is not None:
            return self.engine.abort(entry.msg.rid, message, status) or [
                self._refuse(entry.msg, message, status)]
        return [self._refuse(entry.msg, message, status)]

    def _tell_decode(self, kv: KVRequest, message: str) -> None:
        self.send_control(kv.notify_endpoint, KVStatus(room=kv.room, failed=True,
                                                       message=message))

    def _refuse(self, msg: GenerateRequest, message: str, status: int | None,
                param: str | None = None) -> TokenDelta:
        req = Req(msg.rid, list(msg.input_ids), msg.sampling)
        req.finish_reason = FinishReason(type="abort", message=message, status=status,
                                         param=param)
        return self.engine.delta(req)

    def _entry_for_room(self, room: int) -> _Entry | None:
        return self.bootstrap.get(room) or self.forward.get(room) or self.inflight.get(room)

    # ---- accounting ---------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def waiting_on_io(self) -> bool:
        return bool(self.bootstrap or self.early or self.inflight)

    def queue_counts(self) -> tuple[int, ...]:
        return (len(self.bootstrap), len(self.early), len(self.forward), len(self.inflight))

    def load_snapshot(self) -> LoadSnapshot:
        base = self.engine.load_snapshot()
        page = self.engine.pool.page_size
        inflight_tokens = sum(len(e.req.pages) for e in self.inflight.values()) * page
        return LoadSnapshot(
            dp_rank=base.dp_rank,
            timestamp=base.timestamp,
            num_running_reqs=base.num_running_reqs,
            num_waiting_reqs=base.num_waiting_reqs + len(self.bootstrap),
            num_used_tokens=base.num_used_tokens,
            num_total_tokens=base.num_total_tokens,
            num_active_tokens=base.num_active_tokens - inflight_tokens,
            max_total_num_tokens=base.max_total_num_tokens,
            token_usage=base.token_usage,
            num_bootstrap_reqs=len(self.bootstrap),
            num_inflight_reqs=len(self.inflight),
        )
