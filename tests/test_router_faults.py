"""Faults through the real router process: prefill down, decode down, a worker answering 500,
a worker that hangs (SIGSTOP), a prefill failing mid-stream. For each: the client's status and
how fast it comes, which breaker is charged (only the side that failed), ejection and
re-admission by health checks, and that nothing that may have run is sent twice."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from test_router_mocks import (
    FAST_HEALTH,
    MockFleet,
    MockProcess,
    RouterProcess,
    post,
    stream_events,
    wait_until,
)


@pytest.fixture
def fleet():
    fleet = MockFleet()
    yield fleet
    fleet.close()


def pd_args(prefills, decodes, *extra: str, health=FAST_HEALTH) -> list[str]:
    args = ["--pd-disaggregation", *health]
    for p in prefills:
        args += ["--prefill", p.url]
    for d in decodes:
        args += ["--decode", d.url]
    return args + list(extra)


SLOW_HEALTH = ("--health-check-interval-secs", "60")  # only the start-up check


def timed_post(url: str, body: dict, **kw):
    started = time.monotonic()
    status, headers, answer = post(url, body, **kw)
    return status, answer, time.monotonic() - started


def metric(router: RouterProcess, needle: str) -> float:
    with urllib.request.urlopen(router.url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(needle):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_prefill_500_opens_only_the_prefill_breaker(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.mode = "fail500"
    decode.delay_s = 0.2  # decode is healthy but slower: the prefill failure comes first
    with RouterProcess(*pd_args([prefill], [decode], "--cb-failure-threshold", "2",
                                "--cb-timeout-duration-secs", "60")) as router:
        for _ in range(2):
            status, answer, _ = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 500 and answer["error"]["message"] == "prefill exploded"
        workers = router.workers()
        assert workers[prefill.url]["breaker"] == "open"
        assert workers[decode.url]["breaker"] == "closed"
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        assert status == 503 and elapsed < 0.5
        assert "no healthy prefill worker" in answer["error"]["message"]
        assert "breaker open" in answer["error"]["message"]
    assert len(prefill.calls) == 2 and len(decode.calls) == 2  # nothing replayed
    time.sleep(0.1)
    assert decode.aborted == 2  # the decode legs were cancelled, not left running


def test_decode_500_opens_only_the_decode_breaker(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    decode.mode = "fail500"
    with RouterProcess(*pd_args([prefill], [decode], "--cb-failure-threshold", "2")) as router:
        for _ in range(2):
            status, answer, _ = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 500 and answer["error"]["message"] == "decode exploded"
        workers = router.workers()
        assert workers[decode.url]["breaker"] == "open"
        assert workers[prefill.url]["breaker"] == "closed"
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        assert status == 503 and elapsed < 0.5
        assert "no healthy decode worker" in answer["error"]["message"]
    assert len(decode.calls) == 2 and len(prefill.calls) == 2


def test_prefill_down_fast_503_no_replay_then_ejection_and_readmission(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        fleet.stop_worker(prefill)
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        assert status in (503, 502) and elapsed < 1.0, answer
        assert "prefill worker" in answer["error"]["message"]
        # the decode leg may have been sent with the dead prefill's address: it is cancelled,
        # never sent again
        assert len(decode.calls) <= 1
        wait_until(lambda: router.workers()[prefill.url]["health"] == "ejected", 5,
                   "prefill ejected")
        calls_before = len(decode.calls)
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        assert status == 503 and elapsed < 0.5
        assert answer["error"]["message"].startswith("no healthy prefill worker")
        assert answer["error"]["type"] == "service_unavailable" and answer["error"]["code"] == 503
        assert len(decode.calls) == calls_before  # nothing sent when nothing can succeed
        assert urllib_status(router.url + "/readiness") == 503
        fleet.start_worker(prefill)
        wait_until(lambda: router.workers()[prefill.url]["health"] == "healthy", 5,
                   "prefill re-admitted")
        assert post(router.url + "/generate", {"text": "hi"})[0] == 200


def test_decode_refused_is_retried_on_another_decode_without_replaying_prefill(fleet):
    prefill = fleet.add("prefill")
    dead, alive = fleet.add("decode"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [dead, alive], "--decode-policy", "round_robin",
                                "--retry-initial-backoff-ms", "5", health=SLOW_HEALTH)) as router:
        fleet.stop_worker(dead)  # still listed healthy: its health check runs once a minute
        for _ in range(4):
            status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 200 and answer["meta_info"]["worker"] == alive.url
        assert metric(router, 'pdserve_router_retries_total{role="decode"}') >= 1
        assert router.workers()[prefill.url]["breaker"] == "closed"
    assert len(prefill.calls) == 4 and len(alive.calls) == 4
    # each decode leg carried the room and address of its own prefill leg
    assert [b["bootstrap_room"] for b in prefill.inference_calls()] == [
        b["bootstrap_room"] for b in alive.inference_calls()]


def test_only_decode_down_fast_503_and_prefill_cancelled(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.delay_s = 5.0  # would hold the request if it were not cancelled
    with RouterProcess(*pd_args([prefill], [decode], health=SLOW_HEALTH)) as router:
        fleet.stop_worker(decode)
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        assert status == 503 and elapsed < 1.0
        assert "decode worker" in answer["error"]["message"]
        assert router.workers()[prefill.url]["breaker"] == "closed"
        wait_until(lambda: prefill.aborted == 1, 5, "the prefill leg cancelled")
    assert len(prefill.calls) == 1


def resume_and_expect_readmitted(router: RouterProcess, worker: MockProcess,
                                 timeout: float) -> None:
    worker.resume()
    wait_until(lambda: router.workers()[worker.url]["available"], timeout,
               f"the {worker.role} re-admitted")
    assert post(router.url + "/generate", {"text": "again"})[0] == 200


def test_hanging_decode_sigstop_times_out_is_ejected_and_readmitted(fleet):
    """The request timeout comes before the ejection here (slower health checks than
    FAST_HEALTH): 504, the decode's breaker charged; then ejected, fast 503s, re-admitted."""
    prefill = fleet.add("prefill")
    decode = MockProcess("decode")
    slower = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
              "--health-failure-threshold", "2", "--health-success-threshold", "2")
    try:
        with RouterProcess(*pd_args([prefill], [decode], "--request-timeout-secs", "1.5",
                                    "--cb-failure-threshold", "1",
                                    "--cb-timeout-duration-secs", "0.5",
                                    health=slower)) as router:
            assert post(router.url + "/generate", {"text": "warm"})[0] == 200
            decode.pause()
            status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 504 and 1.2 < elapsed < 3.5, (status, answer, elapsed)
            assert "decode worker" in answer["error"]["message"]
            workers = router.workers()
            assert workers[prefill.url]["breaker"] == "closed"  # prefill answered fine
            wait_until(lambda: router.workers()[decode.url]["health"] == "ejected", 8,
                       "the hung decode ejected")
            status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 503 and elapsed < 0.5
            resume_and_expect_readmitted(router, decode, timeout=15)
    finally:
        decode.stop()


def test_prefill_failure_mid_stream_ends_with_a_well_formed_error_event(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.mode, prefill.delay_s = "stream_error", 0.3
    decode.chunks, decode.chunk_interval_s = 40, 0.05  # 2 s of tokens if left running
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate", {"text": "hi", "stream": True}))
        assert events[0][1] == 200
        payloads = [e for _, e in events[1:]]
        assert payloads[-1] == "[DONE]"
        error = payloads[-2]["error"]  # parsed as JSON by stream_events
        assert error["code"] == 500 and "kv transfer failed" in error["message"]
        assert error["type"] == "server_error" and "param" in error
        tokens = [p for p in payloads[:-2] if "text" in p]
        assert 1 <= len(tokens) < 40  # decode was streaming, and was stopped
        assert events[-1][0] < 1.5
        wait_until(lambda: decode.aborted == 1, 5, "the decode leg cancelled")
        assert metric(router, 'pdserve_router_upstream_failures_total{kind="stream",role='
                              f'"prefill",worker="{prefill.url}"}}') == 1.0
        assert router.workers()[decode.url]["breaker"] == "closed"
    assert len(decode.calls) == 1


def test_prefill_connection_dropped_mid_stream(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.mode, prefill.delay_s = "drop", 0.2
    decode.chunks, decode.chunk_interval_s = 40, 0.05
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate", {"text": "hi", "stream": True}))
    payloads = [e for _, e in events[1:]]
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == 502


def test_decode_failure_before_streaming_is_a_json_error(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    decode.mode = "fail500"
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate", {"text": "hi", "stream": True}))
    assert events[0][1] == 500 and events[1][1]["error"]["message"] == "decode exploded"


def test_zero_workers_fast_503_with_a_clear_message(fleet):
    prefill = fleet.add("prefill")
    with RouterProcess("--pd-disaggregation", "--prefill", prefill.url, *FAST_HEALTH,
                       ready=False) as router:
        # the prefill is admitted after its first health checks; only decode is missing then
        wait_until(lambda: router.workers()[prefill.url]["available"], 10, "prefill admitted")
        status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
        # "fast": no wait on any timeout (connect 5 s, request 1,800 s); the bound leaves room
        # for a loaded 2-core CI machine
        assert status == 503 and elapsed < 2.0
        assert answer["error"] == {"message": "no decode worker is registered",
                                   "type": "service_unavailable", "param": None, "code": 503}
        assert urllib_status(router.url + "/health") == 503
        assert urllib_status(router.url + "/liveness") == 200
    assert not prefill.calls


def urllib_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_client_leaving_mid_stream_aborts_both_legs(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.delay_s = 3.0
    decode.chunks, decode.chunk_interval_s = 60, 0.05
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = stream_events(router.url + "/generate", {"text": "hi", "stream": True})
        assert next(events)[1] == 200
        assert "text" in next(events)[1]
        events.close()  # the client hangs up after the first token
        wait_until(lambda: decode.aborted == 1 and prefill.aborted == 1, 5,
                   "both legs aborted")
        assert router.workers()[decode.url]["breaker"] == "closed"
        assert router.workers()[prefill.url]["breaker"] == "closed"
        assert post(router.url + "/generate", {"text": "still fine"})[0] == 200


def test_requests_on_a_hung_decode_fail_fast_once_it_is_ejected(fleet):
    """A decode that hangs (SIGSTOP: no answer to anything) while it holds a request: once
    health checks eject it, the request fails with 503 at once, not at the request timeout."""
    prefill = fleet.add("prefill")
    decode = MockProcess("decode")
    try:
        with RouterProcess(*pd_args([prefill], [decode], "--request-timeout-secs", "30")
                           ) as router:
            assert post(router.url + "/generate", {"text": "warm"})[0] == 200
            decode.pause()
            status, answer, elapsed = timed_post(router.url + "/generate", {"text": "hi"})
            assert status == 503 and elapsed < 5, (status, answer, elapsed)
            message = answer["error"]["message"]
            assert "decode worker" in message and "stopped answering health checks" in message
            assert router.workers()[decode.url]["health"] == "ejected"
            resume_and_expect_readmitted(router, decode, timeout=10)
    finally:
        decode.stop()


def test_a_worker_that_answers_its_checks_with_errors_keeps_its_running_requests(fleet):
    """Draining (or degraded) workers answer /health with 503: they are ejected for new
    requests, but what they are working on is not cut."""
    import concurrent.futures

    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    decode.delay_s = 2.0
    with RouterProcess(*pd_args([prefill], [decode], "--request-timeout-secs", "30")
                       ) as router:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(timed_post, router.url + "/generate", {"text": "slow"})
            wait_until(lambda: decode.inference_calls(), 5, "the decode got the request")
            decode.healthy = False
            wait_until(lambda: router.workers()[decode.url]["health"] == "ejected", 5,
                       "the draining decode ejected")
            status, answer, elapsed = running.result(timeout=10)
        assert status == 200 and elapsed >= 1.9, (status, answer, elapsed)
        assert decode.aborted == 0
