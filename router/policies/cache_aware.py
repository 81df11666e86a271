"""cache_aware: send a prompt where its prefix was sent before, unless load is out of balance.

SGLang router's algorithm, with one approximate prefix tree per worker (`radix_tree.py`):

1. Load = the router's in-flight requests per candidate. If the spread is large in both senses,
   `max - min > --balance-abs-threshold` and `max > min * --balance-rel-threshold`, the
   least-loaded worker wins (balance before affinity).
2. Otherwise the worker whose tree matches the longest prefix wins if matched / prompt length
   exceeds `--cache-threshold`; below it the worker with the smallest tree (the most free cache
   space, probably) wins.
3. The prompt is inserted into the winner's tree. Every `--eviction-interval-secs` each tree is
   trimmed to `--max-tree-size` elements, least recently used leaves first.

A request without a prompt (nothing to match) goes to the least-loaded worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.policies.base import Policy, RouteKey
from router.policies.radix_tree import RadixTree
from router.workers import Worker


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float, balance_abs_threshold: int,
                 balance_rel_threshold: float, max_tree_size: int,
                 eviction_interval_s: float):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self.trees: dict[str, RadixTree] = {}

    def tree(self, worker: Worker) -> RadixTree:
        tree = self.trees.get(worker.url)
        if tree is None:
            tree = self.trees[worker.url] = RadixTree()
        return tree

    def is_imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.inflight for w in candidates]
        high, low = max(loads), min(loads)
        return (high - low > self.balance_abs_threshold
                and high > low * self.balance_rel_threshold)

    def select(self, candidates: Sequence[Worker], key: RouteKey) -> Worker:
        sequence = key.sequence
        if sequence is None or len(candidates) == 1:
            chosen = min(candidates, key=lambda w: w.inflight)
        elif self.is_imbalanced(candidates):
            chosen = min(candidates, key=lambda w: w.inflight)
        else:
            matches = [(self.tree(w).match_len(sequence), w) for w in candidates]
            best_len, best = max(matches, key=lambda m: m[0])
            if best_len / len(sequence) > self.cache_threshold:
                chosen = best
            else:
                chosen = min(candidates, key=lambda w: self.tree(w).size)
        if sequence is not None:
            tree = self.tree(chosen)
            tree.insert(sequence)
            if tree.size > 2 * self.max_tree_size:  # a burst between evictions stays bounded
                tree.evict(self.max_tree_size)
        return chosen

    def evict_all(self) -> None:
        for tree in self.trees.values():
            tree.evict(self.max_tree_size)

    def forget(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)

    async def maintain(self) -> None:
        while True:
            await asyncio.sleep(self.eviction_interval_s)
            self.evict_all()
