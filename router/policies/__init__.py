"""Worker-selection policies, one file each, chosen by name (`--policy`, `--prefill-policy`,
`--decode-policy`): random, round_robin, power_of_two, cache_aware."""

from __future__ import annotations

from router.config import RouterArgs
from router.policies.base import Policy, RouteKey
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.random_policy import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy

__all__ = ["Policy", "RouteKey", "make_policy"]


def make_policy(name: str, args: RouterArgs) -> Policy:
    if name == "random":
        return RandomPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy(args.load_stale_secs)
    if name == "cache_aware":
        return CacheAwarePolicy(args.cache_threshold, args.balance_abs_threshold,
                                args.balance_rel_threshold, args.max_tree_size,
                                args.eviction_interval_secs)
    raise ValueError(f"unknown policy {name!r}")
