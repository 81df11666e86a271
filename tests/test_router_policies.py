"""Router worker-selection policies, in-process: random, round_robin, power_of_two (with stale
loads), cache_aware (prefix affinity, balance fallback, eviction) and its radix tree."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from router.breaker import CircuitBreaker
from router.config import RouterArgs
from router.loads import RankLoad, WorkerLoad, parse_loads
from router.policies import RouteKey, make_policy
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.radix_tree import RadixTree, common_prefix_len
from router.policies.random_policy import RandomPolicy
from router.workers import Health, Role, Worker


def set_inflight(worker: Worker, n: int) -> None:
    """As if the router had n requests open on the worker."""
    worker.open_legs = {object() for _ in range(n)}


def workers(n: int) -> list[Worker]:
    out = []
    for i in range(n):
        w = Worker(f"http://10.0.0.{i + 1}:8000", Role.PREFILL, CircuitBreaker(3, 1, 60.0))
        w.health = Health.HEALTHY
        out.append(w)
    return out


def load(requests: int, age_s: float = 0.0, tokens: int = 0) -> WorkerLoad:
    return WorkerLoad(fetched_at=time.monotonic() - age_s, num_dp_slots=1,
                      ranks=[RankLoad(0, True, True, requests, tokens)], requests=requests,
                      tokens=tokens)


def test_make_policy_knows_every_name():
    args = RouterArgs()
    for name in ("random", "round_robin", "power_of_two", "cache_aware"):
        assert make_policy(name, args).name == name
    with pytest.raises(ValueError):
        make_policy("least_magic", args)


def test_random_spreads_over_all_workers():
    ws = workers(3)
    policy = RandomPolicy(random.Random(0))
    counts = Counter(policy.select(ws, RouteKey()).url for _ in range(3000))
    assert set(counts) == {w.url for w in ws}
    assert min(counts.values()) > 800


def test_round_robin_cycles_and_skips_missing_workers():
    ws = workers(3)
    policy = make_policy("round_robin", RouterArgs())
    assert [policy.select(ws, RouteKey()) for _ in range(6)] == ws + ws
    # an ejected worker is simply not a candidate: the others alternate
    picks = [policy.select([ws[0], ws[2]], RouteKey()) for _ in range(4)]
    assert Counter(p.url for p in picks) == {ws[0].url: 2, ws[2].url: 2}


def test_power_of_two_prefers_the_lighter_known_load():
    ws = workers(2)
    ws[0].load, ws[1].load = load(50), load(3)
    policy = PowerOfTwoPolicy(stale_after_s=2.0, rng=random.Random(1))
    picks = [policy.select(ws, RouteKey()) for _ in range(10)]
    # the router's own dispatches count until the next poll: after 47 picks the loads are
    # level, so the first 10 all go to the lighter worker
    assert all(p is ws[1] for p in picks)
    assert ws[1].load.extra_requests == 10


def test_power_of_two_ties_broken_by_tokens():
    ws = workers(2)
    ws[0].load, ws[1].load = load(4, tokens=900), load(4, tokens=100)
    policy = PowerOfTwoPolicy(stale_after_s=2.0, rng=random.Random(2))
    assert policy.select(ws, RouteKey()) is ws[1]


def test_power_of_two_stale_loads_are_unknown_and_fall_back_to_round_robin():
    ws = workers(3)
    # worker 0 looks idle but its load is 10 s old: it must not attract everything
    ws[0].load, ws[1].load, ws[2].load = load(0, age_s=10.0), load(90, age_s=10.0), None
    policy = PowerOfTwoPolicy(stale_after_s=2.0, rng=random.Random(3))
    picks = [policy.select(ws, RouteKey()) for _ in range(6)]
    assert picks == ws + ws
    assert ws[0].load.extra_requests == 0  # nothing speculated on unknown loads
    # one fresh load is not enough to compare with anything: still round robin
    ws[1].load = load(90)
    assert [policy.select(ws, RouteKey()) for _ in range(3)] == ws


def test_parse_loads_reads_worker_reply_and_marks_stale_ranks_unknown():
    body = {"num_dp_slots": 3, "loads": [
        {"dp_rank": 0, "state": "active", "timestamp": 1.0, "num_running_reqs": 2,
         "num_waiting_reqs": 1, "num_total_tokens": 300, "stale": False},
        {"dp_rank": 1, "state": "active", "timestamp": 1.0, "num_running_reqs": 0,
         "num_waiting_reqs": 0, "num_total_tokens": 0, "stale": True},
        {"dp_rank": 2, "state": "reserved", "stale": True},
    ], "aggregate": {"num_running_reqs": 2, "num_waiting_reqs": 1, "num_total_tokens": 300}}
    parsed = parse_loads(body, time.monotonic())
    assert parsed.num_dp_slots == 3 and parsed.requests == 3 and parsed.tokens == 300
    assert [(r.dp_rank, r.active, r.known) for r in parsed.ranks] == [
        (0, True, True), (1, True, False), (2, False, False)]
    assert parsed.least_loaded_rank().dp_rank == 0  # the idle rank 1 is stale: unknown


def cache_policy(threshold=0.5, abs_t=4, rel_t=1.5, max_size=10_000) -> CacheAwarePolicy:
    return CacheAwarePolicy(threshold, abs_t, rel_t, max_size, eviction_interval_s=60.0)


def test_cache_aware_prefix_affinity():
    ws = workers(3)
    policy = cache_policy()
    system = "You are a helpful assistant. " * 4
    first = policy.select(ws, RouteKey(text=system + "What is 2+2?"))
    # new prompts sharing the long prefix follow it, whoever else is idle
    for question in ("Name a color.", "What is the capital of France?", "Count to 3."):
        assert policy.select(ws, RouteKey(text=system + question)) is first
    # an unrelated prompt goes to the worker with the smallest tree (not the cached one)
    other = policy.select(ws, RouteKey(text="Translate to German: good morning"))
    assert other is not first


def test_cache_aware_works_on_token_ids():
    ws = workers(2)
    policy = cache_policy()
    prefix = tuple(range(100, 164))
    first = policy.select(ws, RouteKey(token_ids=prefix + (1, 2)))
    assert policy.select(ws, RouteKey(token_ids=prefix + (9, 9, 9))) is first


def test_cache_aware_balance_fallback_beats_affinity():
    ws = workers(2)
    policy = cache_policy(abs_t=4, rel_t=1.5)
    prompt = "shared prefix " * 10
    cached = policy.select(ws, RouteKey(text=prompt))
    other = ws[1] if cached is ws[0] else ws[0]
    set_inflight(cached, 10), set_inflight(other, 1)  # 10 - 1 > 4 and 10 > 1 * 1.5: imbalanced
    assert policy.select(ws, RouteKey(text=prompt)) is other
    # within the thresholds, affinity wins again
    set_inflight(cached, 4), set_inflight(other, 1)  # 4 - 1 <= 4
    assert policy.select(ws, RouteKey(text=prompt)) is cached
    set_inflight(cached, 12), set_inflight(other, 9)  # 12 - 9 <= 4
    assert policy.select(ws, RouteKey(text=prompt)) is cached


def test_cache_aware_without_prompt_takes_least_loaded():
    ws = workers(3)
    for w, n in zip(ws, (5, 0, 2)):
        set_inflight(w, n)
    assert cache_policy().select(ws, RouteKey()) is ws[1]


def test_cache_aware_eviction_bounds_each_tree_and_forgets_removed_workers():
    ws = workers(2)
    policy = cache_policy(max_size=100)
    for i in range(50):
        policy.select(ws, RouteKey(text=f"{i:04d}" + "z" * 30))
    policy.evict_all()
    assert all(tree.size <= 100 for tree in policy.trees.values())
    policy.forget(ws[0])
    assert ws[0].url not in policy.trees


def test_radix_tree_match_insert_split():
    tree = RadixTree()
    tree.insert("hello world")
    assert tree.match_len("hello there") == 6
    tree.insert("hello there")
    assert tree.size == len("hello world") + len("there")
    assert tree.match_len("hello world!") == 11
    assert tree.match_len("help") == 3
    assert tree.match_len("") == 0
    tree.insert("hello world")  # already there: no growth
    assert tree.size == len("hello world") + len("there")


def test_radix_tree_evicts_least_recently_used_first():
    now = [0.0]
    tree = RadixTree(clock=lambda: now[0])
    for i, text in enumerate(("aaaa1111", "bbbb2222", "cccc3333")):
        now[0] = float(i)
        tree.insert(text)
    now[0] = 10.0
    tree.match_len("aaaa1111")  # touch: now the most recent
    freed = tree.evict(16)
    assert freed == 8 and tree.size == 16
    assert tree.match_len("bbbb2222") == 0  # the oldest untouched one went
    assert tree.match_len("aaaa1111") == 8 and tree.match_len("cccc3333") == 8


@pytest.mark.parametrize("a,b,expected", [
    ("abcdef", "abcxyz", 3), ("abc", "abc", 3), ("", "abc", 0), ("abc", "ab", 2),
    ((1, 2, 3, 4), (1, 2, 9), 2), ("x" * 1000 + "a", "x" * 1000 + "b", 1000),
])
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected
