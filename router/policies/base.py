"""What every worker-selection policy implements, and what it gets to decide with.

The dispatcher calls `select(candidates, key)` with the *available* workers of one role
(healthy, breaker allowing; never empty) and the request's routing key; the policy returns one
of them. Policies are per role: prefill and decode each have their own instance, so their
counters and prefix trees never mix. `maintain()` runs in the background for policies that
need housekeeping (cache_aware's eviction); `forget(worker)` drops state of a removed worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from router.workers import Worker


@dataclass(slots=True)
class RouteKey:
    """What a request looks like to a policy: its prompt as text, or as token ids."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def sequence(self) -> str | tuple[int, ...] | None:
        return self.text if self.text else (self.token_ids or None)


class Policy(ABC):
    name: str

    @abstractmethod
    def select(self, candidates: Sequence[Worker], key: RouteKey) -> Worker:
        """Picks one of `candidates` (non-empty)."""

    def forget(self, worker: Worker) -> None:
        """The worker was removed from the registry."""

    async def maintain(self) -> None:
        """Background housekeeping; returns at once for policies without any."""
