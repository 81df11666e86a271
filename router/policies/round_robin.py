"""round_robin: available workers in turn.

The counter runs over the list of *available* workers, so an ejected worker is skipped without
giving its turn to its neighbour twice in a row more than once.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RouteKey
from router.workers import Worker


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.counter = 0

    def select(self, candidates: Sequence[Worker], key: RouteKey) -> Worker:
        worker = candidates[self.counter % len(candidates)]
        self.counter += 1
        return worker
