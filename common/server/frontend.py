"""The front end's request bookkeeping ("tokenizer manager"), independent of HTTP.

Lifecycle of one request:
    generate(): register state -> PUSH GenerateRequest to the scheduler (to the DP
                controller: [routing header, request] frames over its Unix stream socket,
                see scheduler_input and frame_stream)
    recv loop:  TextDelta from the detokenizer -> append to the state -> wake the consumer
    consumer:   iterates snapshots until `finished`; leaving early (client gone, cancelled)
                sends AbortRequest, so the scheduler frees the request's KV at once.

Control calls (flush_cache, stats) are request/reply over the same channels, matched by id.
If the backend dies, `fail_all` finishes every waiting consumer with a 503 abort; if the DP
controller's channel breaks, the same happens and `fatal_reason` makes the service's watchdog
stop the service. A request too large for that channel gets a 413 on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.messages import frontend_input, scheduler_input
from common.messages.detokenizer_input import EngineStats, FlushCacheResult
from common.messages.frontend_input import TextDelta
from common.messages.sampling import FinishReason, TopLogprobs
from common.server.frame_stream import AsyncFrameSender
from common.server.ipc import IpcPaths

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """Everything known about one request so far (cumulative)."""

    rid: str
    prompt_tokens: int = 0
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprob_start: int = 0
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    dp_rank: int | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def e2e_latency(self) -> float:
        return (self.finished_at or time.monotonic()) - self.created

    def apply(self, delta: TextDelta) -> None:
        self.dp_rank = delta.dp_rank
        self.prompt_tokens = delta.prompt_tokens
        self.text += delta.text
        self.output_ids.extend(delta.new_ids)
        self.output_logprobs.extend(delta.output_logprobs)
        self.output_top_logprobs.extend(delta.output_top_logprobs)
        if delta.input_logprobs:
            self.input_logprobs = delta.input_logprobs
            self.input_top_logprobs = delta.input_top_logprobs
            self.input_logprob_start = delta.input_logprob_start
        if delta.finished:
            self.finish(delta.finish_reason)

    def finish(self, reason: FinishReason | None) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finished_at = time.monotonic()


@dataclass(slots=True)
class _State:
    out: RequestOutput
    updated: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _Control:
    future: asyncio.Future
    expected: int
    replies: list = field(default_factory=list)


class FrontEnd:
    def __init__(self, ipc: IpcPaths, request_target: str, num_ranks: int = 1,
                 via_controller: bool = False,
                 on_finish: Callable[[RequestOutput], None] | None = None):
        self.ctx = zmq.asyncio.Context()
        # The DP controller's input (a Unix stream socket), or the only scheduler's ZMQ PULL
        # when there is no controller (`generate_many` and `send_control` write to them).
        self.to_controller: AsyncFrameSender | None = None
        self.to_scheduler: zmq.asyncio.Socket | None = None
        if via_controller:
            self.to_controller = AsyncFrameSender(request_target,
                                                  on_broken=self._controller_channel_broken)
        else:
            self.to_scheduler = self.ctx.socket(zmq.PUSH)
            self.to_scheduler.connect(request_target)
        self.from_detokenizer = self.ctx.socket(zmq.PULL)
        self.from_detokenizer.bind(ipc.frontend_input)
        self.via_controller = via_controller
        self.on_finish = on_finish
        # Ranks whose scheduler answers control requests (started and alive).
        self.live_ranks: set[int] = set(range(num_ranks))
        self.states: dict[str, _State] = {}
        self.pending_control: dict[str, _Control] = {}
        self._ids = itertools.count()
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        # Set when this front end can no longer reach its schedulers at all (the DP
        # controller's channel broke); the service's watchdog stops the service then.
        self.fatal_reason: str | None = None

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self.to_controller is not None:
            self.to_controller.close()
        self.ctx.destroy(linger=0)

    @property
    def num_inflight(self) -> int:
        return len(self.states)

    def is_inflight(self, rid: str) -> bool:
        return rid in self.states

    # ---- generation -------------------------------------------------------------------
    def generate(self, req: scheduler_input.GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yields the cumulative output after each update; the last one has `finished`."""
        return self.generate_many([req])[0]

    def generate_many(
        self, reqs: list[scheduler_input.GenerateRequest]
    ) -> list[AsyncIterator[RequestOutput]]:
        """Registers and submits every request now (as one multipart message when a DP
        controller is in front of the schedulers: a routing header frame it decodes instead of
        the requests, and one budget refresh for a batch); returns one iterator per request.
        Leaving an iterator early aborts that request."""
        registered: list[_State | None] = []
        to_send: list[scheduler_input.GenerateRequest] = []
        for req in reqs:
            if req.rid in self.states:
                # Two requests raced past the HTTP layer's check with the same rid: refuse this
                # one without touching the other's state (overwriting would strand it).
                registered.append(None)
                continue
            state = _State(RequestOutput(rid=req.rid, prompt_tokens=len(req.input_ids)))
            self.states[req.rid] = state
            registered.append(state)
            if self.dead_reason is not None:
                state.out.finish(FinishReason(type="abort", message=self.dead_reason, status=503))
                state.updated.set()
            else:
                to_send.append(req)
        if to_send:
            try:
                if self.via_controller:
                    # One message: routing header frame(s), then the request frames.
                    self.to_controller.send(scheduler_input.controller_frames(to_send))
                else:
                    for req in to_send:
                        self.to_scheduler.send(scheduler_input.encoder.encode(req), copy=False)
            except ConnectionError as exc:  # on_broken failed them, unless it broke earlier
                self._fail(self._among(to_send), str(exc))
            except ValueError as exc:  # over the controller channel's message size limit
                self._fail(self._among(to_send), f"request too large: {exc}", 413)
        return [
            self._follow(state) if state is not None else self._refused(req)
            for req, state in zip(reqs, registered)
        ]

    async def _refused(self, req: scheduler_input.GenerateRequest) -> AsyncIterator[RequestOutput]:
        dup = RequestOutput(rid=req.rid, prompt_tokens=len(req.input_ids))
        dup.finish(FinishReason(
            type="abort", message=f"rid {req.rid!r} is already in flight", status=409
        ))
        yield dup

    async def _follow(self, state: _State) -> AsyncIterator[RequestOutput]:
        rid = state.out.rid
        try:
            while True:
                await state.updated.wait()
                state.updated.clear()
                yield state.out
                if state.out.finished:
                    return
        finally:
            self.states.pop(rid, None)
            if not state.out.finished and self.dead_reason is None:
                self.abort(rid, "client disconnected", state.out.dp_rank)

    def release(self, rids: list[str]) -> None:
        """Forget requests whose consumer is gone, aborting unfinished ones. Covers iterators
        that were cancelled before they ever started (their `finally` never runs)."""
        for rid in rids:
            state = self.states.pop(rid, None)
            if state is not None and not state.out.finished and self.dead_reason is None:
                self.abort(rid, "client disconnected", state.out.dp_rank)

    def abort(self, rid: str, message: str = "aborted by request",
              dp_rank: int | None = None) -> None:
        if dp_rank is None and rid in self.states:
            dp_rank = self.states[rid].out.dp_rank
        msg = scheduler_input.AbortRequest(rid=rid, message=message, dp_rank=dp_rank)
        self.send_control(msg)  # when the controller is gone, so is every request it placed

    def send_control(self, msg) -> bool:
        """A single-frame message (abort, flush, stats, slot state). False when the DP
        controller's channel is broken (never raises: callers include the watchdog)."""
        raw = scheduler_input.encoder.encode(msg)
        if self.to_controller is None:
            self.to_scheduler.send(raw)
            return True
        try:
            self.to_controller.send((raw,))
        except ConnectionError:
            return False
        return True

    def _controller_channel_broken(self, reason: str) -> None:
        """Requests already handed to the controller are lost with the channel: fail every
        request, and tell the watchdog (the service cannot serve without it)."""
        self.fatal_reason = reason
        self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail(lambda state: True, reason)
        for control in self.pending_control.values():
            if not control.future.done():
                control.future.set_exception(RuntimeError(reason))

    def fail_rank(self, rank: int, reason: str) -> None:
        """A DP rank died: its requests fail now; control requests stop waiting for it."""
        self.live_ranks.discard(rank)
        self.fail_requests_of(rank, reason)
        for control in self.pending_control.values():
            control.expected = min(control.expected, len(self.live_ranks))
            self._maybe_complete(control)

    def fail_requests_of(self, rank: int, reason: str) -> int:
        """Fails the requests a DP rank holds (it lost them: died or restarted); how many."""
        return self._fail(lambda state: state.out.dp_rank == rank, reason)

    @staticmethod
    def _among(reqs: list[scheduler_input.GenerateRequest]):
        rids = {req.rid for req in reqs}
        return lambda state: state.out.rid in rids

    def _fail(self, which, reason: str, status: int = 503) -> int:
        failed = 0
        for state in self.states.values():
            if not state.out.finished and which(state):
                state.out.finish(FinishReason(type="abort", message=reason, status=status))
                state.updated.set()
                failed += 1
        return failed

    # ---- control ----------------------------------------------------------------------
    async def flush_cache(self) -> list[FlushCacheResult]:
        """One result per live DP rank."""
        return await self._control(scheduler_input.FlushCacheRequest, timeout=10.0)

    async def stats(self) -> list[EngineStats]:
        """One entry per live DP rank, in rank order."""
        replies = await self._control(scheduler_input.StatsRequest, timeout=10.0)
        return sorted(replies, key=lambda r: r.dp_rank)

    async def _control(self, msg_type, timeout: float) -> list:
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        request_id = f"ctl-{next(self._ids)}"
        control = _Control(asyncio.get_running_loop().create_future(), len(self.live_ranks))
        self.pending_control[request_id] = control
        try:
            if not self.send_control(msg_type(request_id=request_id)):
                if control.future.done():
                    control.future.exception()  # fail_all set it: retrieved, not logged
                raise RuntimeError(self.dead_reason or "DP controller channel is closed")
            self._maybe_complete(control)
            return await asyncio.wait_for(control.future, timeout)
        finally:
            self.pending_control.pop(request_id, None)

    @staticmethod
    def _maybe_complete(control: _Control) -> None:
        if not control.future.done() and len(control.replies) >= control.expected:
            control.future.set_result(list(control.replies))

    # ---- receive loop -----------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = frontend_input.decoder.decode(await self.from_detokenizer.recv())
            if isinstance(msg, frontend_input.TextBatch):
                for delta in msg.deltas:
                    state = self.states.get(delta.rid)
                    if state is None:
                        continue  # the consumer left (and aborted) already
                    state.out.apply(delta)
                    state.updated.set()
                    if delta.finished and self.on_finish is not None:
                        self.on_finish(state.out)
            elif isinstance(msg, frontend_input.DispatchReport):
                self._on_dispatch(msg)
            else:
                control = self.pending_control.get(msg.request_id)
                if control is not None:
                    control.replies.append(msg)
                    self._maybe_complete(control)

    def _on_dispatch(self, report: frontend_input.DispatchReport) -> None:
        for rid, rank in zip(report.rids, report.ranks):
            state = self.states.get(rid)
            if state is None or state.out.finished:
                continue
            state.out.dp_rank = rank
            if rank not in self.live_ranks:
                state.out.finish(FinishReason(
                    type="abort", message=f"DP rank {rank} is unavailable", status=503
                ))
                state.updated.set()
        for failure in report.failed:
            state = self.states.get(failure.rid)
            if state is not None and not state.out.finished:
                state.out.finish(FinishReason(
                    type="abort", message=failure.message, status=failure.status,
                    param=failure.param,
                ))
                state.updated.set()
