"""The front end's view of its DP ranks: slot states, the load board, elastic changes.

Slot states mirror the controller's (`common/dp/dispatch.py`): ACTIVE ranks take requests,
RESERVED slots are not started or were removed, UNAVAILABLE ranks died. Changes made here are
sent to the controller as `SetSlotState`, so both sides agree:

    activate(k):    start scheduler-k if it is not running (blocks a worker thread, not the
                    event loop) -> ACTIVE
    deactivate(k):  ACTIVE -> RESERVED: no new requests; those running finish normally
    mark_dead(k):   any -> UNAVAILABLE; its in-flight requests fail with 503

Ranks on other nodes (multi-node) are not processes node 0 can watch: `check_remote_ranks`
marks one dead when its load snapshot has not changed for --remote-rank-timeout seconds (ranks
publish at least once a second while idle, and every few steps while busy), and makes it
ACTIVE again when snapshots move; a snapshot from a new scheduler process (its `incarnation`)
fails the requests the old process held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.dp.dispatch import SlotState
from common.loads.board import BoardError, LoadBoard
from common.loads.snapshot import LoadSnapshot
from common.messages.scheduler_input import SetSlotState
from common.server.errors import ApiError
from common.server.frontend import FrontEnd

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DpRanks:
    method: str
    num_active: int
    num_slots: int
    board: LoadBoard
    frontend: FrontEnd
    uses_controller: bool
    start_scheduler: Callable[[int], None]
    is_running: Callable[[int], bool]
    remote_ranks: frozenset[int] = frozenset()  # ranks on other nodes (multi-node)
    states: list[SlotState] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Remote ranks: the last snapshot timestamp seen and when (local monotonic clock) it changed.
    _remote_seen: dict[int, tuple[float | None, float]] = field(default_factory=dict)
    _incarnations: dict[int, int] = field(default_factory=dict)  # remote rank -> process id

    def __post_init__(self) -> None:
        self.states = [SlotState.ACTIVE] * self.num_active + [SlotState.RESERVED] * (
            self.num_slots - self.num_active
        )

    @property
    def available(self) -> list[int]:
        return [r for r, s in enumerate(self.states) if s is SlotState.ACTIVE]

    @property
    def unavailable(self) -> list[int]:
        return [r for r, s in enumerate(self.states) if s is SlotState.UNAVAILABLE]

    def loads(self) -> list[LoadSnapshot | None]:
        return self.board.read_all()

    def mark_dead(self, rank: int, reason: str) -> None:
        self._set(rank, SlotState.UNAVAILABLE)
        self.frontend.fail_rank(rank, reason)

    def check_remote_ranks(self, timeout: float, now: float) -> None:
        """Liveness of the ranks on other nodes. Only whether a rank's snapshot timestamp
        changed is used, timed on this node's clock (the other node's clock is never compared).
        A rank that never published counts from the first check."""
        for rank in sorted(self.remote_ranks):
            try:
                snap = self.board.read(rank)
            except BoardError as exc:  # a slot caught mid-write: judge it next time
                logger.debug("load board: %s", exc)
                continue
            stamp = None if snap is None else snap.timestamp
            if snap is not None and snap.incarnation:
                self._check_incarnation(rank, snap.incarnation)
            seen = self._remote_seen.get(rank)
            if seen is None or seen[0] != stamp:
                self._remote_seen[rank] = (stamp, now)
                # Only silence makes a remote rank UNAVAILABLE (node 0 runs no process for it).
                if seen is not None and self.states[rank] is SlotState.UNAVAILABLE:
                    logger.warning("DP rank %d publishes its load again: back in service", rank)
                    self._set(rank, SlotState.ACTIVE)
                continue
            if self.states[rank] is SlotState.ACTIVE and now - seen[1] > timeout:
                silence = ("has not published a load snapshot" if stamp is None
                           else "sent no load snapshot")
                reason = (f"DP rank {rank} (on another node) {silence} for {timeout:g} s: its "
                          "node is down, unreachable or still starting")
                logger.error("%s; it is now unavailable", reason)
                self.mark_dead(rank, reason)

    def _check_incarnation(self, rank: int, incarnation: int) -> None:
        """A new scheduler process behind a remote rank (its node restarted faster than the
        timeout): the requests the old one held are lost; fail them, keep the rank."""
        before = self._incarnations.get(rank)
        self._incarnations[rank] = incarnation
        if before is None or before == incarnation:
            return
        failed = self.frontend.fail_requests_of(
            rank, f"DP rank {rank} (on another node) restarted and lost this request")
        logger.warning("DP rank %d restarted on its node (a new scheduler process); %d "
                       "request(s) it held failed", rank, failed)

    async def activate(self, rank: int) -> None:
        self._check_rank(rank)
        async with self._lock:
            if self.states[rank] is SlotState.ACTIVE:
                return
            if rank in self.remote_ranks:  # its node runs it: nothing to start here
                self._remote_seen.pop(rank, None)  # a full timeout for it to show up
                self._set(rank, SlotState.ACTIVE)
                return
            if not self.is_running(rank):
                loop = asyncio.get_running_loop()
                try:
                    await loop.run_in_executor(None, self.start_scheduler, rank)
                except RuntimeError as exc:
                    raise ApiError(f"could not start DP rank {rank}: {exc}", None, 503) from None
            self._set(rank, SlotState.ACTIVE)

    async def deactivate(self, rank: int) -> None:
        self._check_rank(rank)
        async with self._lock:
            if self.states[rank] is SlotState.ACTIVE and len(self.available) == 1:
                raise ApiError("cannot remove the last active DP rank", "dp_rank", 409)
            lost = rank in self.remote_ranks and self.states[rank] is SlotState.UNAVAILABLE
            if self.states[rank] is SlotState.ACTIVE or lost:
                self._set(rank, SlotState.RESERVED)  # a lost rank does not come back by itself

    def _check_rank(self, rank: int) -> None:
        if not self.uses_controller:
            raise ApiError("this service has a single DP slot; start it with --max-ep-size",
                           "dp_rank", 409)
        if not 0 <= rank < self.num_slots:
            raise ApiError(f"dp_rank {rank} is out of range [0, {self.num_slots})", "dp_rank",
                           404)

    def _set(self, rank: int, state: SlotState) -> None:
        self.states[rank] = state
        if state is SlotState.ACTIVE:
            self.frontend.live_ranks.add(rank)
        else:
            self.frontend.live_ranks.discard(rank)
        if self.uses_controller:
            self.frontend.send_control(SetSlotState(dp_rank=rank, state=state.value))
        logger.info("DP rank %d is now %s", rank, state.value)
