"""Choosing the dp_rank of each tokenized request (SPEC section 2): pure logic, no sockets.

Slots: `num_slots` worker slots (`--max-ep-size`), of which `active` are started; each slot is
ACTIVE, RESERVED (not started) or UNAVAILABLE (its scheduler died). Priority 0, for every
method: a request's `routed_dp_rank` goes to that slot and changes nothing else (no round-robin
advance, no budget change).

    round_robin            slot = active[counter % len(active)]; unavailable slots are skipped;
                           a full lap of unavailable slots is a 503
    follow_bootstrap_room  slot = room % num_slots (reserved slots count: decode computes the
                           same modulus from the slot count the prefill topology reports)
    total_requests         argmin(running + waiting), ties to the lowest slot; then +1 request
    total_tokens           argmin over (tokens, requests); then +len(input_ids) tokens, +1

Load-aware budget: before a dispatch, at most once per `refresh_interval`, the budget is reset
from the latest snapshots; a snapshot whose timestamp did not change since the last refresh is
ignored. Between refreshes the speculative increments spread a burst over the ranks (refreshing
on every request would send a whole burst to the rank the board still shows lightest). A batch
refreshes once, then dispatches every item without refreshing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.loads.snapshot import LoadSnapshot

METHODS = ("round_robin", "follow_bootstrap_room", "total_requests", "total_tokens")
LOAD_AWARE = ("total_requests", "total_tokens")


class SlotState(enum.Enum):
    ACTIVE = "active"
    RESERVED = "reserved"
    UNAVAILABLE = "unavailable"


class DispatchError(Exception):
    """A per-request failure: goes back to that client only."""

    def __init__(self, message: str, status: int, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True)
class DispatchItem:
    num_tokens: int
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


def resolve_method(method: str, disaggregation_mode: str) -> tuple[str, str | None]:
    """The method in force and, when the flag was rewritten, a warning explaining why."""
    if method == "auto":
        return ("follow_bootstrap_room" if disaggregation_mode == "prefill" else "round_robin"), None
    if disaggregation_mode == "prefill" and method == "round_robin":
        return "follow_bootstrap_room", (
            "--load-balance-method round_robin on a prefill service breaks the PD rendezvous "
            "(decode finds prefill ranks by bootstrap_room % dp_size); using "
            "follow_bootstrap_room instead"
        )
    if method not in METHODS:
        raise ValueError(f"--load-balance-method must be auto or one of {METHODS}")
    return method, None


class Dispatcher:
    def __init__(
        self,
        method: str,
        num_slots: int,
        num_active: int,
        read_loads: Callable[[], Sequence[LoadSnapshot | None]] | None = None,
        refresh_interval: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown dispatch method {method!r}")
        if not 1 <= num_active <= num_slots:
            raise ValueError("need 1 <= active workers <= slots")
        self.method = method
        self.num_slots = num_slots
        self.states = [SlotState.ACTIVE] * num_active + [SlotState.RESERVED] * (
            num_slots - num_active
        )
        self.rr_counter = 0
        self.read_loads = read_loads
        self.refresh_interval = refresh_interval
        self.clock = clock
        self.requests = [0] * num_slots
        self.tokens = [0] * num_slots
        self._last_refresh = float("-inf")
        self._seen_timestamps: list[float | None] = [None] * num_slots
        self._load_aware = method in LOAD_AWARE
        self._pick = {
            "round_robin": self._round_robin,
            "follow_bootstrap_room": self._follow_room,
            "total_requests": self._least_requests,
            "total_tokens": self._least_tokens,
        }[method]
        self._cache_slots()

    # ---- worker set --------------------------------------------------------------------
    def _cache_slots(self) -> None:
        """The slot lists every dispatch reads, rebuilt only when a state changes."""
        self._active = tuple(i for i, s in enumerate(self.states) if s is not SlotState.RESERVED)
        self._available = tuple(i for i, s in enumerate(self.states) if s is SlotState.ACTIVE)
        self._up = [s is SlotState.ACTIVE for s in self.states]

    @property
    def active(self) -> list[int]:
        """Slots that take round-robin turns: started ones, dead or alive."""
        return list(self._active)

    def set_state(self, slot: int, state: SlotState) -> None:
        self.states[slot] = state
        self._cache_slots()

    def is_available(self, slot: int) -> bool:
        return self._up[slot]

    # ---- dispatch ----------------------------------------------------------------------
    def dispatch(self, item: DispatchItem) -> int:
        return self.place(item.num_tokens, item.routed_dp_rank, item.bootstrap_room)

    def place(self, num_tokens: int, routed_dp_rank: int | None = None,
              bootstrap_room: int | None = None) -> int:
        """The rank of one request (a batch of one: refreshes the budget when it is due);
        raises DispatchError when it cannot be placed. The controller's hot path."""
        if routed_dp_rank is not None:
            return self._routed(routed_dp_rank)
        if self._load_aware:
            self.maybe_refresh()
        return self._pick(num_tokens, bootstrap_room)

    def dispatch_batch(self, items: Sequence[DispatchItem]) -> list[int]:
        """One rank per item; raises DispatchError for the first item that cannot be placed."""
        ranks = self.place_batch(items)
        for r in ranks:
            if isinstance(r, DispatchError):
                raise r
        return ranks

    def place_batch(self, items: Sequence[DispatchItem]) -> list[int | DispatchError]:
        """One rank, or the error for that item alone, per item; one budget refresh. An item is
        anything with DispatchItem's three attributes (the controller passes RouteHeaders)."""
        if self._load_aware and any(i.routed_dp_rank is None for i in items):
            self.maybe_refresh()
        out: list[int | DispatchError] = []
        for item in items:
            try:
                if item.routed_dp_rank is not None:
                    out.append(self._routed(item.routed_dp_rank))
                else:
                    out.append(self._pick(item.num_tokens, item.bootstrap_room))
            except DispatchError as exc:
                out.append(exc)
        return out

    def _routed(self, rank: int) -> int:
        if not 0 <= rank < self.num_slots:
            raise DispatchError(
                f"routed_dp_rank {rank} is out of range [0, {self.num_slots})", 400,
                "routed_dp_rank",
            )
        if not self._up[rank]:
            raise DispatchError(
                f"routed_dp_rank {rank} is {self.states[rank].value}", 503, "routed_dp_rank"
            )
        return rank

    def _round_robin(self, num_tokens: int = 0, room: int | None = None) -> int:
        active, up = self._active, self._up
        n = len(active)
        if not n:
            raise DispatchError("no DP worker is available", 503)
        counter = self.rr_counter % n
        slot = active[counter]
        if up[slot]:  # the usual case: its turn, and alive
            self.rr_counter = (counter + 1) % n
            return slot
        for _ in range(n):
            slot = active[counter]
            counter = (counter + 1) % n
            if up[slot]:
                self.rr_counter = counter
                return slot
        self.rr_counter = counter
        raise DispatchError("no DP worker is available", 503)

    def _follow_room(self, num_tokens: int = 0, room: int | None = None) -> int:
        if room is None:
            raise DispatchError(
                "this prefill service pins requests by bootstrap_room, and the request has "
                "none: send prefill traffic through the router", 400, "bootstrap_room",
            )
        slot = room % self.num_slots
        if not self._up[slot]:
            raise DispatchError(
                f"bootstrap_room {room} maps to DP rank {slot}, which is "
                f"{self.states[slot].value}", 503, "bootstrap_room",
            )
        return slot

    def _least_requests(self, num_tokens: int, room: int | None = None) -> int:
        """argmin(requests), ties to the lowest slot (min keeps the first of equals)."""
        if not self._available:
            raise DispatchError("no DP worker is available", 503)
        slot = min(self._available, key=self.requests.__getitem__)
        self.requests[slot] += 1
        self.tokens[slot] += num_tokens
        return slot

    def _least_tokens(self, num_tokens: int, room: int | None = None) -> int:
        """argmin over (tokens, requests), ties to the lowest slot."""
        tokens, requests = self.tokens, self.requests
        slot = -1
        best_t = best_r = 0
        for i in self._available:  # ascending: a strict < keeps the lowest of equals
            t = tokens[i]
            if slot < 0 or t < best_t or (t == best_t and requests[i] < best_r):
                slot, best_t, best_r = i, t, requests[i]
        if slot < 0:
            raise DispatchError("no DP worker is available", 503)
        requests[slot] += 1
        tokens[slot] += num_tokens
        return slot

    # ---- budget ------------------------------------------------------------------------
    def maybe_refresh(self) -> bool:
        now = self.clock()
        if self.read_loads is None or now - self._last_refresh < self.refresh_interval:
            return False
        self._last_refresh = now
        for snap in self.read_loads():
            if snap is None or not 0 <= snap.dp_rank < self.num_slots:
                continue
            if snap.timestamp == self._seen_timestamps[snap.dp_rank]:
                continue  # nothing new: keep the speculative increments
            self._seen_timestamps[snap.dp_rank] = snap.timestamp
            self.requests[snap.dp_rank] = snap.num_requests
            self.tokens[snap.dp_rank] = snap.num_total_tokens
        return True
