"""random: a uniformly random available worker."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy, RouteKey
from router.workers import Worker


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], key: RouteKey) -> Worker:
        return candidates[self.rng.randrange(len(candidates))]
