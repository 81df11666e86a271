"""What every HTTP handler of one service needs, and the fan-out of one HTTP request into
engine requests (batch items, `n` samples) run concurrently."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from common.config import ServerArgs
from common.engine.tokenizer import Tokenizer
from common.messages.launch import SchedulerReady
from common.messages.sampling import FinishReason
from common.messages.scheduler_input import GenerateRequest
from common.server.errors import ApiError
from common.server.frontend import FrontEnd, RequestOutput
from common.server.protocol import Limits

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
    draining: bool = False
    unhealthy_reason: str | None = None
    started: float = 0.0
    extra_info: dict = field(default_factory=dict)

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


def abort_error(out: RequestOutput) -> ApiError | None:
    """An abort caused by the service (not by the client) becomes an HTTP error."""
    reason = out.finish_reason
    if reason is not None and reason.type == "abort" and reason.status:
        return ApiError(reason.message or "request failed", None, reason.status)
    return None


async def collect(ctx: ServerContext, reqs: list[GenerateRequest]) -> list[RequestOutput]:
    """Run every request to completion; cancelling this aborts all of them."""

    async def one(req: GenerateRequest) -> RequestOutput:
        last = None
        async for out in ctx.frontend.generate(req):
            last = out
        return last

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def stream(
    ctx: ServerContext, reqs: list[GenerateRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (index, cumulative output) as any of the requests progresses.

    Use it under `contextlib.aclosing`: closing it early (client gone, error chunk) aborts the
    requests still running at once instead of whenever the generator is garbage-collected."""
    if len(reqs) == 1:
        async with aclosing(ctx.frontend.generate(reqs[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            async for out in ctx.frontend.generate(req):
                queue.put_nowait((i, out))
        except Exception as exc:  # never leave the consumer waiting
            logger.exception("request %s failed", req.rid)
            failed = RequestOutput(rid=req.rid)
            failed.finish(FinishReason(type="abort", message=str(exc), status=500))
            queue.put_nowait((i, failed))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
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
