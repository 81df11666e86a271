"""Approximate prefix tree of what one worker has probably cached (cache_aware's memory).

A compressed radix tree over strings (request text) or tuples (token ids). The router cannot
see a worker's real KV cache, so it remembers the prompts it sent there: `match_len(key)` says
how much of a new prompt was seen before, `insert(key)` records a prompt, and `evict(max_size)`
drops the least recently used leaves until the tree holds at most `max_size` elements
(characters or token ids). Every node touched by a match or an insert gets the current time.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "label", "parent", "last_access")

    def __init__(self, label: Sequence, parent: _Node | None, now: float):
        self.children: dict = {}
        self.label = label
        self.parent = parent
        self.last_access = now


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix; slice comparisons (C speed) and a binary search, not a
    Python loop over every element."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.root = _Node((), None, clock())
        self.size = 0  # elements stored in all labels

    def match_len(self, key: Sequence) -> int:
        node, i, now = self.root, 0, self.clock()
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            matched = common_prefix_len(child.label, key[i:i + len(child.label)])
            child.last_access = now
            i += matched
            if matched < len(child.label):
                break
            node = child
        return i

    def insert(self, key: Sequence) -> None:
        node, i, now = self.root, 0, self.clock()
        node.last_access = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                node.children[key[i]] = _Node(key[i:], node, now)
                self.size += len(key) - i
                return
            label = child.label
            matched = common_prefix_len(label, key[i:i + len(label)])
            if matched < len(label):
                # Split the edge: node -> middle (shared part) -> child (rest).
                middle = _Node(label[:matched], node, now)
                node.children[key[i]] = middle
                child.label = label[matched:]
                child.parent = middle
                middle.children[child.label[0]] = child
                child = middle
            child.last_access = now
            node = child
            i += matched

    def evict(self, max_size: int) -> int:
        """Removes least recently used leaves until size <= max_size; returns elements freed."""
        if self.size <= max_size:
            return 0
        freed = 0
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self.size > max_size:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            freed += len(leaf.label)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out
