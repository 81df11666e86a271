"""power_of_two: of two random workers with known loads, the lighter one.

Loads come from the workers' `/v1/loads` (see `router/loads.py`): running + waiting requests,
then `num_total_tokens` on ties, plus the router's own dispatches since the last poll. A load
older than `--load-stale-secs` is unknown and is never compared: with fewer than two workers of
known load, the policy falls back to round robin over all candidates (a stale worker keeps
getting its share rather than being guessed at; ejecting dead ones is the health checker's job).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy, RouteKey
from router.policies.round_robin import RoundRobinPolicy
from router.workers import Worker


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def __init__(self, stale_after_s: float, rng: random.Random | None = None):
        self.stale_after_s = stale_after_s
        self.rng = rng or random.Random()
        self.fallback = RoundRobinPolicy()

    def select(self, candidates: Sequence[Worker], key: RouteKey) -> Worker:
        known = [w for w in candidates
                 if w.load is not None and w.load.is_fresh(self.stale_after_s)]
        if len(known) < 2:
            return self.fallback.select(candidates, key)
        first, second = self.rng.sample(known, 2)
        chosen = second if second.load.score < first.load.score else first
        chosen.load.extra_requests += 1  # counted until the next poll replaces the load
        return chosen
