"""The front end's request bookkeeping ("tokenizer manager"), independent of HTTP.

Lifecycle of one request:
    generate(): register state -> PUSH GenerateRequest to the scheduler
    recv loop:  TextDelta from the detokenizer -> append to the state -> wake the consumer
    consumer:   iterates snapshots until `finished`; leaving early (client gone, cancelled)
                sends AbortRequest, so the scheduler frees the request's KV at once.

Control calls (flush_cache, stats) are request/reply over the same channels, matched by id.
If the backend dies, `fail_all` finishes every waiting consumer with a 503 abort.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.messages import frontend_input, scheduler_input
from common.messages.detokenizer_input import EngineStats, FlushCacheResult
from common.messages.frontend_input import TextDelta
from common.messages.sampling import FinishReason, TopLogprobs
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

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def e2e_latency(self) -> float:
        return (self.finished_at or time.monotonic()) - self.created

    def apply(self, delta: TextDelta) -> None:
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


class FrontEnd:
    def __init__(self, ipc: IpcPaths, request_target: str):
        self.ctx = zmq.asyncio.Context()
        # The DP controller's input, or the only scheduler's when there is no controller.
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(request_target)
        self.from_detokenizer = self.ctx.socket(zmq.PULL)
        self.from_detokenizer.bind(ipc.frontend_input)
        self.states: dict[str, _State] = {}
        self.pending_control: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.ctx.destroy(linger=0)

    @property
    def num_inflight(self) -> int:
        return len(self.states)

    def is_inflight(self, rid: str) -> bool:
        return rid in self.states

    # ---- generation -------------------------------------------------------------------
    async def generate(self, req: scheduler_input.GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yields the cumulative output after each update; the last one has `finished`."""
        if req.rid in self.states:
            # Two requests raced past the HTTP layer's check with the same rid: refuse this one
            # without touching the other's state (overwriting it would strand that consumer).
            dup = RequestOutput(rid=req.rid, prompt_tokens=len(req.input_ids))
            dup.finish(FinishReason(
                type="abort", message=f"rid {req.rid!r} is already in flight", status=409
            ))
            yield dup
            return
        state = _State(RequestOutput(rid=req.rid, prompt_tokens=len(req.input_ids)))
        self.states[req.rid] = state
        try:
            if self.dead_reason is not None:
                state.out.finish(FinishReason(type="abort", message=self.dead_reason, status=503))
            else:
                await self.to_scheduler.send(scheduler_input.encoder.encode(req))
            while True:
                await state.updated.wait()
                state.updated.clear()
                yield state.out
                if state.out.finished:
                    return
        finally:
            self.states.pop(req.rid, None)
            if not state.out.finished and self.dead_reason is None:
                self.abort(req.rid, "client disconnected")

    def abort(self, rid: str, message: str = "aborted by request") -> None:
        msg = scheduler_input.AbortRequest(rid=rid, message=message)
        self.to_scheduler.send(scheduler_input.encoder.encode(msg))

    def fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        for state in self.states.values():
            if not state.out.finished:
                state.out.finish(FinishReason(type="abort", message=reason, status=503))
                state.updated.set()
        for fut in self.pending_control.values():
            if not fut.done():
                fut.set_exception(RuntimeError(reason))

    # ---- control ----------------------------------------------------------------------
    async def flush_cache(self) -> FlushCacheResult:
        return await self._control(scheduler_input.FlushCacheRequest, timeout=10.0)

    async def stats(self) -> EngineStats:
        return await self._control(scheduler_input.StatsRequest, timeout=10.0)

    async def _control(self, msg_type, timeout: float):
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        request_id = f"ctl-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self.pending_control[request_id] = fut
        try:
            await self.to_scheduler.send(scheduler_input.encoder.encode(msg_type(request_id=request_id)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.pending_control.pop(request_id, None)

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
            else:
                fut = self.pending_control.get(msg.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
