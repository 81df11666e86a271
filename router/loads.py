"""Worker loads polled from each worker's `GET /v1/loads`, for power_of_two and `--dp-aware`.

Lifecycle: the poller fetches every healthy worker's loads each `--load-poll-interval-secs`
and replaces `worker.load` with a fresh `WorkerLoad`. Between polls the router adds its own
dispatches to `extra_requests` (per worker and per DP rank) so that a burst does not all go
to the worker that looked lightest at the last poll (the same idea as the DP controller's
load budget, SPEC section 2). A load older than `--load-stale-secs`, or one the worker marked
stale, is *unknown*: policies then fall back to load-blind choices instead of trusting it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import msgspec

if TYPE_CHECKING:
    from router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RankLoad:
    dp_rank: int
    active: bool
    known: bool  # the rank has published a snapshot that is not stale
    requests: int  # running + waiting
    tokens: int  # num_total_tokens: held KV plus tokens still to allocate or compute
    extra_requests: int = 0  # router dispatches since the poll

    @property
    def score(self) -> tuple[int, int]:
        return (self.requests + self.extra_requests, self.tokens)


@dataclass(slots=True)
class WorkerLoad:
    fetched_at: float  # time.monotonic() of the poll
    num_dp_slots: int
    ranks: list[RankLoad]
    requests: int
    tokens: int
    extra_requests: int = 0
    raw: dict = field(default_factory=dict, repr=False)

    def is_fresh(self, stale_after_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.fetched_at <= stale_after_s

    @property
    def score(self) -> tuple[int, int]:
        return (self.requests + self.extra_requests, self.tokens)

    def least_loaded_rank(self) -> RankLoad | None:
        """The active rank with a known load and the smallest (requests, tokens), lowest index
        on ties; None if no active rank has a known load."""
        known = [r for r in self.ranks if r.active and r.known]
        return min(known, key=lambda r: (r.score, r.dp_rank)) if known else None


def parse_loads(body: dict, fetched_at: float) -> WorkerLoad:
    """A `/v1/loads` reply (see common/server/loads_api.py) as a WorkerLoad."""
    ranks = []
    for entry in body.get("loads", []):
        known = "timestamp" in entry and not entry.get("stale", False)
        ranks.append(RankLoad(
            dp_rank=int(entry["dp_rank"]),
            active=entry.get("state", "active") == "active",
            known=known,
            requests=int(entry.get("num_running_reqs", 0)) + int(entry.get("num_waiting_reqs", 0)),
            tokens=int(entry.get("num_total_tokens", 0)),
        ))
    aggregate = body.get("aggregate", {})
    return WorkerLoad(
        fetched_at=fetched_at,
        num_dp_slots=int(body.get("num_dp_slots", len(ranks)) or 1),
        ranks=ranks,
        requests=int(aggregate.get("num_running_reqs", 0))
        + int(aggregate.get("num_waiting_reqs", 0)),
        tokens=int(aggregate.get("num_total_tokens", 0)),
        raw=body,
    )


async def fetch_loads(session: aiohttp.ClientSession, worker: Worker,
                      timeout_s: float) -> dict:
    async with session.get(worker.url + "/v1/loads",
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        body = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/v1/loads answered {resp.status}")
        return msgspec.json.decode(body)


class LoadPoller:
    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession,
                 interval_s: float, timeout_s: float):
        self.registry = registry
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def poll_once(self) -> None:
        workers = [w for w in self.registry.all() if w.health.value == "healthy"]
        await asyncio.gather(*(self._poll(w) for w in workers))

    async def _poll(self, worker: Worker) -> None:
        try:
            body = await fetch_loads(self.session, worker, self.timeout_s)
            worker.load = parse_loads(body, time.monotonic())
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, msgspec.DecodeError,
                KeyError, TypeError, ValueError) as exc:
            # The old load ages into "unknown" by itself; nothing else to undo.
            logger.debug("load poll of %s failed: %s", worker.url, exc)

    async def run_forever(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
