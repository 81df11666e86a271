"""What every HTTP handler of one service needs, and the fan-out of one HTTP request into
engine requests (batch items, `n` samples) run concurrently."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from common.config import ServerArgs
from common.engine.tokenizer import Tokenizer
from common.messages.launch import SchedulerReady
from common.messages.sampling import FinishReason
from common.messages.scheduler_input import GenerateRequest
from common.server.errors import ApiError
from common.server.frontend import FrontEnd, RequestOutput
from common.server.protocol import Limits

if TYPE_CHECKING:
    from common.server.dp_ranks import DpRanks
    from common.server.metrics import ServiceMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerContext:
    args: ServerArgs
    model_path: str
    model_name: str
    tokenizer: Tokenizer
    frontend: FrontEnd
    info: SchedulerReady
    limits: Limits
    dp: DpRanks | None = None
    metrics: ServiceMetrics | None = None
    draining: bool = False
    unhealthy_reason: str | None = None
    started: float = 0.0
    process_pids: Callable[[], dict[str, int]] = dict
    # PD: bootstrap rooms of requests in flight here; a room reused while in flight is a 409.
    rooms: set[int] = field(default_factory=set)

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def check_accepting(self) -> None:
        if self.unhealthy_reason is not None:
            raise ApiError(f"service unavailable: {self.unhealthy_reason}", None, 503)
        if self.draining:
            raise ApiError("service is shutting down", None, 503)

    def check_rids_free(self, reqs: list[GenerateRequest]) -> None:
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise ApiError("rid values must be unique within a request", "rid", 400)
        for rid in rids:
            if self.frontend.is_inflight(rid):
                raise ApiError(f"rid {rid!r} is already in flight", "rid", 409)
        self._check_rooms_free(reqs)

    def _check_rooms_free(self, reqs: list[GenerateRequest]) -> None:
        if self.args.disaggregation_mode == "null":
            return
        for r in reqs:
            if r.bootstrap_room in self.rooms:
                raise ApiError(f"bootstrap_room {r.bootstrap_room} is already in flight",
                               "bootstrap_room", 409)

    def claim_rooms(self, reqs: list[GenerateRequest]) -> list[int]:
        """Rooms taken by these requests until `release_rooms` (PD services only). Checked
        again here: another request may have taken one since `check_rids_free`."""
        if self.args.disaggregation_mode == "null":
            return []
        self._check_rooms_free(reqs)
        rooms = [r.bootstrap_room for r in reqs]
        self.rooms.update(rooms)
        return rooms

    def release_rooms(self, rooms: list[int]) -> None:
        self.rooms.difference_update(rooms)


CTX = web.AppKey("ctx", ServerContext)


def abort_error(out: RequestOutput) -> ApiError | None:
    """An abort caused by the service (not by the client) becomes an HTTP error."""
    reason = out.finish_reason
    if reason is not None and reason.type == "abort" and reason.status:
        return ApiError(reason.message or "request failed", reason.param, reason.status)
    return None


async def collect(ctx: ServerContext, reqs: list[GenerateRequest]) -> list[RequestOutput]:
    """Run every request to completion; cancelling this aborts all of them."""

    async def drain(outs: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = None
        async with aclosing(outs):
            async for out in outs:
                last = out
        return last

    rooms = ctx.claim_rooms(reqs)
    iterators = ctx.frontend.generate_many(reqs)
    try:
        return list(await asyncio.gather(*(drain(it) for it in iterators)))
    finally:
        ctx.frontend.release([r.rid for r in reqs])
        ctx.release_rooms(rooms)


async def stream(
    ctx: ServerContext, reqs: list[GenerateRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (index, cumulative output) as any of the requests progresses.

    Use it under `contextlib.aclosing`: closing it early (client gone, error chunk) aborts the
    requests still running at once instead of whenever the generator is garbage-collected."""
    rooms = ctx.claim_rooms(reqs)
    iterators = ctx.frontend.generate_many(reqs)
    if len(reqs) == 1:
        try:
            async with aclosing(iterators[0]) as outs:
                async for out in outs:
                    yield 0, out
        finally:
            ctx.frontend.release([reqs[0].rid])
            ctx.release_rooms(rooms)
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest, outs: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(outs):
                async for out in outs:
                    queue.put_nowait((i, out))
        except Exception as exc:  # never leave the consumer waiting
            logger.exception("request %s failed", req.rid)
            failed = RequestOutput(rid=req.rid)
            failed.finish(FinishReason(type="abort", message=str(exc), status=500))
            queue.put_nowait((i, failed))

    tasks = [
        asyncio.create_task(pump(i, r, it)) for i, (r, it) in enumerate(zip(reqs, iterators))
    ]
    try:
        remaining = len(reqs)
        while remaining:
            i, out = await queue.get()
            yield i, out
            if out.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.frontend.release([r.rid for r in reqs])
        ctx.release_rooms(rooms)
