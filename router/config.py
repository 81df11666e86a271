"""Router arguments: one frozen dataclass, its command-line flags, and start-up validation.

Flag names follow SGLang's router (`sglang-router launch`) so that users can switch:
`--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL --policy ...`, the `--cb-*`,
`--health-*` and `--retry-*` families, `--request-timeout-secs`. Differences from SGLang:
a `--prefill` without a port gets the prefill service's default bootstrap port 8998 (SGLang's
router defaults to none; write `none` explicitly for that), and worker administration is only
enabled when `--api-key` is set.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from common.config import ConfigError

POLICY_NAMES = ("random", "round_robin", "power_of_two", "cache_aware")
DEFAULT_BOOTSTRAP_PORT = 8998  # `--disaggregation-bootstrap-port` default of the prefill service


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    url: str
    bootstrap_port: int | None = DEFAULT_BOOTSTRAP_PORT


@dataclass(frozen=True, slots=True)
class RouterArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    pd_disaggregation: bool = False
    prefill: tuple[PrefillSpec, ...] = ()
    decode: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    # cache_aware (same meaning and defaults as SGLang's router)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2**24
    # loads (power_of_two, --dp-aware)
    dp_aware: bool = False
    load_poll_interval_secs: float = 0.25
    load_stale_secs: float = 2.0
    # upstream connections
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 5.0
    max_payload_size: int = 512 * 1024 * 1024
    # retries: only of requests that no worker can have started (connection refused)
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 2000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    # circuit breakers
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    disable_circuit_breaker: bool = False
    # health checks
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False
    api_key: str | None = field(default=None, repr=False)
    log_level: str = "info"

    def __post_init__(self) -> None:
        policies = [self.policy, self.prefill_policy, self.decode_policy]
        checks = [
            (self.port, 0 <= self.port < 65536, "--port must be in [0, 65535]"),
            (policies, all(p is None or p in POLICY_NAMES for p in policies),
             f"--policy, --prefill-policy and --decode-policy must be one of {POLICY_NAMES}"),
            (self.worker_urls, not (self.pd_disaggregation and self.worker_urls),
             "--worker-urls is for plain mode; with --pd-disaggregation use --prefill/--decode"),
            (self.prefill, self.pd_disaggregation or not (self.prefill or self.decode),
             "--prefill and --decode need --pd-disaggregation"),
            (self.cache_threshold, 0.0 <= self.cache_threshold <= 1.0,
             "--cache-threshold must be in [0, 1]"),
            (self.balance_abs_threshold, self.balance_abs_threshold >= 0,
             "--balance-abs-threshold must be >= 0"),
            (self.balance_rel_threshold, self.balance_rel_threshold >= 1.0,
             "--balance-rel-threshold must be >= 1"),
            (self.max_tree_size, self.max_tree_size >= 1, "--max-tree-size must be >= 1"),
            (self.eviction_interval_secs, self.eviction_interval_secs > 0,
             "--eviction-interval-secs must be > 0"),
            (self.load_poll_interval_secs, self.load_poll_interval_secs > 0,
             "--load-poll-interval-secs must be > 0"),
            (self.load_stale_secs, self.load_stale_secs > 0, "--load-stale-secs must be > 0"),
            (self.request_timeout_secs, self.request_timeout_secs > 0,
             "--request-timeout-secs must be > 0"),
            (self.connect_timeout_secs, self.connect_timeout_secs > 0,
             "--connect-timeout-secs must be > 0"),
            (self.retry_max_retries, self.retry_max_retries >= 1,
             "--retry-max-retries (attempts, the first included) must be >= 1"),
            (self.retry_backoff_multiplier, self.retry_backoff_multiplier >= 1.0,
             "--retry-backoff-multiplier must be >= 1"),
            (self.retry_jitter_factor, 0.0 <= self.retry_jitter_factor <= 1.0,
             "--retry-jitter-factor must be in [0, 1]"),
            (self.cb_failure_threshold, self.cb_failure_threshold >= 1,
             "--cb-failure-threshold must be >= 1"),
            (self.cb_success_threshold, self.cb_success_threshold >= 1,
             "--cb-success-threshold must be >= 1"),
            (self.cb_timeout_duration_secs, self.cb_timeout_duration_secs >= 0,
             "--cb-timeout-duration-secs must be >= 0"),
            (self.health_check_interval_secs, self.health_check_interval_secs > 0,
             "--health-check-interval-secs must be > 0"),
            (self.health_check_timeout_secs, self.health_check_timeout_secs > 0,
             "--health-check-timeout-secs must be > 0"),
            (self.health_failure_threshold, self.health_failure_threshold >= 1,
             "--health-failure-threshold must be >= 1"),
            (self.health_success_threshold, self.health_success_threshold >= 1,
             "--health-success-threshold must be >= 1"),
            (self.health_check_endpoint, self.health_check_endpoint.startswith("/"),
             "--health-check-endpoint must start with /"),
            (self.api_key, self.api_key is None or len(self.api_key) > 0,
             "--api-key must not be empty"),
        ]
        for value, ok, message in checks:
            if not ok:
                raise ConfigError(f"{message} (got {value!r})")
        for url in (*(p.url for p in self.prefill), *self.decode, *self.worker_urls):
            check_worker_url(url)

    @property
    def resolved_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def resolved_decode_policy(self) -> str:
        return self.decode_policy or self.policy

    @property
    def max_attempts(self) -> int:
        return 1 if self.disable_retries else self.retry_max_retries

    @property
    def needs_loads(self) -> bool:
        """Whether the load poller runs: power_of_two and --dp-aware read workers' /v1/loads."""
        used = {self.resolved_prefill_policy, self.resolved_decode_policy}
        return self.dp_aware or "power_of_two" in used

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["api_key"] = None if self.api_key is None else "<set>"
        return out


def check_worker_url(url: str) -> str:
    from yarl import URL

    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"worker URL {url!r} must look like http://HOST:PORT")
    return url


def _prefill_spec(values: list[str]) -> PrefillSpec:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT] (got {values!r})")
    if len(values) == 1:
        return PrefillSpec(values[0])
    raw = values[1]
    if raw.lower() == "none":
        return PrefillSpec(values[0], None)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"--prefill bootstrap port must be a port number or 'none' (got {raw!r})")
    return PrefillSpec(values[0], int(raw))


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = RouterArgs()
    a = parser.add_argument
    a("--host", default=d.host)
    a("--port", type=int, default=d.port)
    a("--pd-disaggregation", action="store_true",
      help="route each request to a prefill and a decode service (PD disaggregation)")
    a("--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]",
      help=f"a prefill service and its bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}; "
           "'none' sends no port); repeatable")
    a("--decode", action="append", default=[], metavar="URL",
      help="a decode service; repeatable")
    a("--worker-urls", nargs="*", default=[], metavar="URL",
      help="plain mode: colocated services (`pdserve serve`)")
    a("--policy", default=d.policy, choices=POLICY_NAMES,
      help="worker selection policy; in PD mode for both sides unless overridden")
    a("--prefill-policy", default=None, choices=POLICY_NAMES)
    a("--decode-policy", default=None, choices=POLICY_NAMES)
    a("--cache-threshold", type=float, default=d.cache_threshold,
      help="cache_aware: route by prefix when matched/prompt length exceeds this")
    a("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
      help="cache_aware: balance by load when max - min in-flight requests exceeds this ...")
    a("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
      help="... and max > min x this")
    a("--eviction-interval-secs", type=float, default=d.eviction_interval_secs,
      help="cache_aware: seconds between evictions of the prefix trees")
    a("--max-tree-size", type=int, default=d.max_tree_size,
      help="cache_aware: characters or token ids kept per worker's prefix tree")
    a("--dp-aware", action="store_true",
      help="pick the prefill DP rank from its loads (room %% dp_size == rank) and pin decode's "
           "rank with routed_dp_rank")
    a("--load-poll-interval-secs", type=float, default=d.load_poll_interval_secs,
      help="seconds between polls of the workers' /v1/loads (power_of_two, --dp-aware)")
    a("--load-stale-secs", type=float, default=d.load_stale_secs,
      help="loads older than this count as unknown")
    a("--request-timeout-secs", type=float, default=d.request_timeout_secs,
      help="bound on one upstream request, streaming included")
    a("--connect-timeout-secs", type=float, default=d.connect_timeout_secs)
    a("--max-payload-size", type=int, default=d.max_payload_size, help="bytes of a request body")
    a("--retry-max-retries", type=int, default=d.retry_max_retries,
      help="attempts per request, the first included; only requests that could not have "
           "reached a worker (connection refused) are retried")
    a("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_ms)
    a("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_ms)
    a("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier)
    a("--retry-jitter-factor", type=float, default=d.retry_jitter_factor)
    a("--disable-retries", action="store_true")
    a("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
      help="consecutive failures of a worker that open its circuit breaker")
    a("--cb-success-threshold", type=int, default=d.cb_success_threshold,
      help="successes in half-open state that close it again")
    a("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_duration_secs,
      help="seconds an open breaker waits before letting a probe request through")
    a("--disable-circuit-breaker", action="store_true")
    a("--health-check-interval-secs", type=float, default=d.health_check_interval_secs)
    a("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs)
    a("--health-failure-threshold", type=int, default=d.health_failure_threshold,
      help="consecutive failed checks that eject a worker")
    a("--health-success-threshold", type=int, default=d.health_success_threshold,
      help="consecutive passed checks that re-admit an ejected worker")
    a("--health-check-endpoint", default=d.health_check_endpoint)
    a("--disable-health-check", action="store_true",
      help="admit every worker at once and never eject one")
    a("--api-key", default=None,
      help="Bearer token required by every route but /health, /liveness, /readiness and "
           "/metrics; also enables POST/DELETE /workers")
    a("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))


def router_args_from_namespace(ns: argparse.Namespace) -> RouterArgs:
    names = {f.name for f in dataclasses.fields(RouterArgs)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    values["prefill"] = tuple(_prefill_spec(v) for v in values.get("prefill") or [])
    values["decode"] = tuple(values.get("decode") or [])
    values["worker_urls"] = tuple(values.get("worker_urls") or [])
    return RouterArgs(**values)


def parse_router_args(argv: list[str]) -> RouterArgs:
    """For tests and embedding: the flags of `pdserve router` to RouterArgs."""
    parser = argparse.ArgumentParser(prog="pdserve router")
    add_router_args(parser)
    return router_args_from_namespace(parser.parse_args(argv))
