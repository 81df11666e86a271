"""Router pieces in-process: circuit breaker, health thresholds, request planning (rooms per item
and sample, rids, bootstrap fields), pass-through, auth, flags, logprob merging, and the lean
upstream HTTP client against a real aiohttp server."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from aiohttp import web

from common.config import ConfigError
from common.server.errors import ApiError
from router.auth import bearer_token, is_authorized
from router.breaker import BreakerState, CircuitBreaker
from router.config import DEFAULT_BOOTSTRAP_PORT, PrefillSpec, parse_router_args
from router.health import apply_check, cut_stalled_legs
from router.http_client import ConnectionPool, UpstreamConnectError, UpstreamTimeout
from router.logprobs import merge_bodies
from router.request_plan import (
    ROOM_LIMIT,
    add_bootstrap,
    add_rid,
    plan_request,
    random_rooms,
    room_for_rank,
)
from router.workers import Health, Role, Worker

# ---- circuit breaker -------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_recovers_through_half_open():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_s=5.0,
                             clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # resets the streak
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allows()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now += 5.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_dispatch()  # the probe
    assert not breaker.allows()  # one probe at a time
    breaker.record_success()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_dispatch()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_breaker_half_open_failure_reopens_and_cancelled_probe_is_released():
    clock = Clock()
    breaker = CircuitBreaker(1, 1, 5.0, clock=clock)
    breaker.record_failure()
    clock.now += 5.0
    breaker.on_dispatch()
    breaker.release_probe()  # the probe was cancelled: no verdict
    assert breaker.allows()
    breaker.on_dispatch()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and breaker.times_opened == 2


def test_disabled_breaker_always_allows():
    breaker = CircuitBreaker(1, 1, 60.0, enabled=False)
    breaker.record_failure()
    assert breaker.allows()


# ---- health thresholds ---------------------------------------------------------------------


def test_health_admits_new_worker_at_once_ejects_and_readmits_by_thresholds():
    w = Worker("http://h:1", Role.DECODE, CircuitBreaker(3, 1, 1.0))
    assert w.health is Health.PENDING and not w.available
    apply_check(w, True, None, failure_threshold=2, success_threshold=3)
    assert w.health is Health.HEALTHY and w.available
    apply_check(w, False, "boom", 2, 3)
    assert w.health is Health.HEALTHY
    apply_check(w, False, "boom", 2, 3)
    assert w.health is Health.EJECTED and not w.available and w.last_check_error == "boom"
    apply_check(w, True, None, 2, 3)
    apply_check(w, True, None, 2, 3)
    assert w.health is Health.EJECTED
    apply_check(w, True, None, 2, 3)
    assert w.health is Health.HEALTHY


class _FakeResponse:
    def __init__(self, last_data: float, complete: bool = False):
        self.last_data, self.complete, self.error = last_data, complete, None

    def abandon(self, error: BaseException) -> None:
        self.error = error


class _FakeLeg:
    def __init__(self, response):
        self.response = response


def test_only_silence_without_any_answer_counts_as_unresponsive():
    w = Worker("http://h:1", Role.DECODE, CircuitBreaker(3, 1, 1.0))
    apply_check(w, True, None, 2, 2, now=1.0)
    apply_check(w, False, "answered 503", 2, 2, answered=True, now=2.0)
    assert w.unresponsive_since is None  # it answers: draining or degraded, not hung
    apply_check(w, False, "timed out", 2, 2, answered=False, now=3.0)
    apply_check(w, False, "timed out", 2, 2, answered=False, now=4.0)
    assert w.unresponsive_since == 3.0 and w.health is Health.EJECTED
    apply_check(w, False, "answered 503", 2, 2, answered=True, now=5.0)
    assert w.unresponsive_since is None
    apply_check(w, True, None, 2, 2, now=6.0)
    assert w.unresponsive_since is None


def test_stalled_legs_of_an_ejected_unresponsive_worker_are_cut_and_the_others_kept():
    w = Worker("http://h:1", Role.DECODE, CircuitBreaker(3, 1, 1.0))
    silent, nothing_yet, streaming, finished, connecting = (
        _FakeLeg(_FakeResponse(last_data=9.0)), _FakeLeg(_FakeResponse(last_data=0.0)),
        _FakeLeg(_FakeResponse(last_data=10.5)), _FakeLeg(_FakeResponse(9.0, complete=True)),
        _FakeLeg(None))
    w.open_legs = {silent, nothing_yet, streaming, finished, connecting}
    apply_check(w, True, None, 2, 2, now=1.0)
    apply_check(w, False, "timed out", 2, 2, answered=False, now=10.0)
    assert cut_stalled_legs(w) == 0  # not ejected yet
    apply_check(w, False, "timed out", 2, 2, answered=False, now=11.0)
    assert cut_stalled_legs(w) == 2
    assert "stopped answering health checks (timed out)" in str(silent.response.error)
    assert nothing_yet.response.error is not None
    assert streaming.response.error is None and finished.response.error is None
    w.unresponsive_since = None  # an ejected worker that answers again (with errors)
    w.open_legs = {_FakeLeg(_FakeResponse(last_data=0.0))}
    assert cut_stalled_legs(w) == 0


def test_worker_url_parts():
    w = Worker("http://[::1]:30001/", Role.PREFILL, CircuitBreaker(1, 1, 1.0), 9000)
    assert (w.url, w.host, w.port, w.scheme, w.base_path) == ("http://[::1]:30001", "::1",
                                                               30001, "http", "")
    w = Worker("https://gpu-7.example/sglang", Role.DECODE, CircuitBreaker(1, 1, 1.0))
    assert (w.host, w.port, w.base_path) == ("gpu-7.example", 443, "/sglang")


# ---- request planning --------------------------------------------------------------------


def test_plan_counts_rooms_per_prompt_and_sample():
    assert plan_request("generate", {"text": "hi"}).num_rooms == 1
    plan = plan_request("generate", {"text": ["a", "b", "c"]})
    assert (plan.num_prompts, plan.num_rooms, plan.is_batch) == (3, 3, True)
    plan = plan_request("generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}})
    assert (plan.num_prompts, plan.num_rooms) == (2, 4)
    plan = plan_request("generate", {"text": ["a", "b"],
                                     "sampling_params": [{"n": 3}, {"n": 1}]})
    assert plan.samples_per_prompt == [3, 1] and plan.num_rooms == 4
    assert plan_request("generate", {"input_ids": [5, 6, 7]}).key.token_ids == (5, 6, 7)
    plan = plan_request("completions", {"prompt": ["x", "y"], "n": 3})
    assert plan.num_rooms == 6 and plan.key.text == "x"
    assert plan_request("completions", {"prompt": [[1, 2], [3, 4]]}).num_rooms == 2
    plan = plan_request("chat", {"messages": [{"role": "user", "content": "hey"}], "n": 2})
    assert plan.num_rooms == 2 and "hey" in plan.key.text


def test_plan_refuses_non_object_and_tolerates_odd_shapes():
    with pytest.raises(ApiError):
        plan_request("generate", [1, 2])
    # a bad n or shape is the worker's to reject; planning must not crash on it
    assert plan_request("generate", {"text": "a", "sampling_params": {"n": "x"}}).num_rooms == 1
    assert plan_request("completions", {"prompt": 7}).num_rooms == 1


def test_bootstrap_fields_single_batch_and_samples():
    rng = random.Random(0)
    plan = plan_request("generate", {"text": "hi", "custom_field": {"keep": [1, 2]}})
    add_bootstrap(plan, "10.1.2.3", 8998, random_rooms(plan.num_rooms, rng))
    assert plan.body["bootstrap_host"] == "10.1.2.3" and plan.body["bootstrap_port"] == 8998
    assert isinstance(plan.body["bootstrap_room"], int)
    assert 0 <= plan.body["bootstrap_room"] < ROOM_LIMIT
    assert plan.body["custom_field"] == {"keep": [1, 2]}  # pass-through
    plan = plan_request("completions", {"prompt": ["a", "b"], "n": 2})
    add_bootstrap(plan, "h", None, random_rooms(plan.num_rooms, rng))
    rooms = plan.body["bootstrap_room"]
    assert isinstance(rooms, list) and len(rooms) == 4 and len(set(rooms)) == 4
    assert plan.body["bootstrap_port"] is None
    # a client's own room is replaced: the rendezvous belongs to the router
    plan = plan_request("generate", {"text": "x", "bootstrap_room": 5})
    add_bootstrap(plan, "h", 1, [77])
    assert plan.body["bootstrap_room"] == 77


def test_room_for_rank_is_in_range_and_lands_on_the_rank():
    rng = random.Random(5)
    for slots in (1, 2, 3, 7, 8):
        for rank in range(slots):
            for _ in range(50):
                room = room_for_rank(rank, slots, rng)
                assert 0 <= room < ROOM_LIMIT and room % slots == rank
    assert max(room_for_rank(0, 1, rng) for _ in range(200)) > ROOM_LIMIT // 4  # spread out


def test_rids_single_batch_and_client_rid_kept():
    plan = plan_request("generate", {"text": "a"})
    add_rid(plan, "req-1")
    assert plan.body["rid"] == "req-1"
    plan = plan_request("generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}})
    add_rid(plan, "req-2")
    assert plan.body["rid"] == ["req-2-0", "req-2-1", "req-2-2"]
    plan = plan_request("completions", {"prompt": ["a", "b"]})
    add_rid(plan, "req-3")
    assert plan.body["rid"] == "req-3"  # the OpenAI routes derive <id>-<i> per item
    plan = plan_request("generate", {"text": "a", "rid": "mine"})
    add_rid(plan, "req-4")
    assert plan.body["rid"] == "mine"


# ---- auth and flags ----------------------------------------------------------------------


def test_auth_bearer_constant_time():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    assert is_authorized(None, None)
    assert is_authorized("s3cret", "Bearer s3cret")
    assert not is_authorized("s3cret", "Bearer s3cre")
    assert not is_authorized("s3cret", None)


def test_flags_sglang_spelling():
    args = parse_router_args([
        "--pd-disaggregation", "--prefill", "http://p1:30000", "9000",
        "--prefill", "http://p2:30000", "--prefill", "http://p3:30000", "none",
        "--decode", "http://d1:30001", "--decode", "http://d2:30001",
        "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
        "--cb-failure-threshold", "4", "--disable-retries", "--api-key", "k"])
    assert args.prefill == (PrefillSpec("http://p1:30000", 9000),
                            PrefillSpec("http://p2:30000", DEFAULT_BOOTSTRAP_PORT),
                            PrefillSpec("http://p3:30000", None))
    assert args.decode == ("http://d1:30001", "http://d2:30001")
    assert args.resolved_prefill_policy == "cache_aware"
    assert args.resolved_decode_policy == "power_of_two" and args.needs_loads
    assert args.cb_failure_threshold == 4 and args.max_attempts == 1
    assert args.to_dict()["api_key"] == "<set>"
    plain = parse_router_args(["--worker-urls", "http://a:1", "http://b:2"])
    assert plain.worker_urls == ("http://a:1", "http://b:2") and not plain.pd_disaggregation


@pytest.mark.parametrize("argv,flag", [
    (["--pd-disaggregation", "--prefill", "http://p:1", "99999"], "bootstrap port"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "1", "2"], "--prefill"),
    (["--decode", "http://d:1"], "--pd-disaggregation"),
    (["--pd-disaggregation", "--worker-urls", "http://a:1"], "--worker-urls"),
    (["--worker-urls", "not-a-url"], "worker URL"),
    (["--cache-threshold", "1.5"], "--cache-threshold"),
    (["--retry-max-retries", "0"], "--retry-max-retries"),
])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse_router_args(argv)


# ---- logprobs --------------------------------------------------------------------------


def test_merge_prompt_logprobs_single_and_batch():
    prefill = {"meta_info": {"input_token_logprobs": [[-1.0, 5, None]],
                             "input_top_logprobs": [None]}}
    decode = {"text": "x", "meta_info": {"input_token_logprobs": [],
                                         "output_token_logprobs": [[-0.1, 9, None]]}}
    merged = msgspec.json.decode(merge_bodies(msgspec.json.encode(decode),
                                              msgspec.json.encode(prefill)))
    assert merged["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None]]
    assert merged["meta_info"]["input_top_logprobs"] == [None]
    assert merged["meta_info"]["output_token_logprobs"] == [[-0.1, 9, None]]
    batch = merge_bodies(msgspec.json.encode([decode, decode]),
                         msgspec.json.encode([prefill, {"meta_info": {}}]))
    items = msgspec.json.decode(batch)
    assert items[0]["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None]]
    assert items[1]["meta_info"]["input_token_logprobs"] == []
    assert merge_bodies(b"not json", b"{}") == b"not json"


# ---- lean HTTP client ----------------------------------------------------------------------


@pytest.fixture
async def echo_server():
    hits = []

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        hits.append((request.path, request.headers.get("X-Request-Id"), body))
        if request.path == "/chunked":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for piece in (b"data: 1\n\n", b"data: 2\n\n", b"x" * 70000):
                await response.write(piece)
            await response.write_eof()
            return response
        if request.path == "/slow":
            await asyncio.sleep(5)
        return web.Response(body=b"echo:" + body, status=201 if request.path == "/201" else 200,
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield port, hits
    await runner.cleanup()


async def test_http_client_reuses_connections_and_parses_both_framings(echo_server):
    port, hits = echo_server
    pool = ConnectionPool(connect_timeout_s=2.0, request_timeout_s=5.0)
    try:
        for i in range(3):
            response = await pool.post("http", "127.0.0.1", port, "/201", b'{"i": %d}' % i,
                                       b"X-Request-Id: abc\r\n")
            assert response.status == 201
            assert response.content_type.startswith("application/json")
            assert await response.read() == b'echo:{"i": %d}' % i
            response.release()
        assert sum(len(v) for v in pool.idle.values()) == 1  # one connection, reused
        assert hits[0][1] == "abc"
        response = await pool.post("http", "127.0.0.1", port, "/chunked", b"{}")
        body = await response.read()
        assert body == b"data: 1\n\ndata: 2\n\n" + b"x" * 70000 and response.complete
        response.release()
    finally:
        pool.close()


async def test_http_client_refused_and_timeout_errors(echo_server):
    port, _ = echo_server
    from server_utils import free_port

    pool = ConnectionPool(connect_timeout_s=1.0, request_timeout_s=0.3)
    try:
        with pytest.raises(UpstreamConnectError):
            await pool.post("http", "127.0.0.1", free_port(), "/x", b"{}")
        with pytest.raises(UpstreamTimeout):
            await pool.post("http", "127.0.0.1", port, "/slow", b"{}")
        assert not pool.busy and not any(pool.idle.values())  # a timed-out one is not reused
    finally:
        pool.close()


async def test_leg_start_settles_by_callback_on_fresh_and_pooled_connections(echo_server):
    """The PD prefill leg runs without a task: `Leg.start` sends (connecting first when no
    idle connection is pooled) and calls back once with (failure, body); `finish(None)` before
    that cancels it without a callback or a charge."""
    from server_utils import free_port

    from router.upstream import Leg, LegFailure

    port, _ = echo_server
    pool = ConnectionPool(connect_timeout_s=1.0, request_timeout_s=5.0)
    worker = Worker(f"http://127.0.0.1:{port}", Role.PREFILL, CircuitBreaker(1, 1, 60.0))
    worker.health = Health.HEALTHY
    loop = asyncio.get_running_loop()

    async def run(path: str, target: Worker = worker) -> tuple[LegFailure | None, bytes]:
        done = loop.create_future()
        Leg(pool, target, path, b'{"a": 1}', b"").start(
            lambda failure, body: done.set_result((failure, body)), lambda: True)
        return await asyncio.wait_for(done, 5)

    try:
        for _ in range(2):  # first on a new connection, then on the pooled one
            assert await run("/ok") == (None, b'echo:{"a": 1}')
        assert worker.inflight == 0 and sum(len(v) for v in pool.idle.values()) == 1
        failure, _ = await run("/chunked")
        assert failure is None
        gone = Worker(f"http://127.0.0.1:{free_port()}", Role.PREFILL, CircuitBreaker(1, 1, 60.0))
        failure, _ = await run("/x", gone)
        assert failure.kind == "connect" and gone.breaker.state is BreakerState.OPEN
        called = []
        leg = Leg(pool, worker, "/slow", b"{}", b"")
        leg.start(lambda *a: called.append(a), lambda: True)
        await asyncio.sleep(0.1)
        leg.finish(None)
        await asyncio.sleep(0.1)
        assert called == [] and worker.inflight == 0
        assert worker.breaker.state is BreakerState.CLOSED
    finally:
        pool.close()
