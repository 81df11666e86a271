"""The dispatch policies and the load-aware budget, without processes (SPEC section 2)."""

from __future__ import annotations

from collections import Counter

import pytest

from common.dp.dispatch import (
    DispatchError,
    DispatchItem,
    Dispatcher,
    SlotState,
    resolve_method,
)
from common.loads.snapshot import LoadSnapshot


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBoard:
    def __init__(self, n: int) -> None:
        self.snaps: list[LoadSnapshot | None] = [None] * n
        self.reads = 0

    def set(self, rank: int, ts: float, running: int = 0, waiting: int = 0, tokens: int = 0):
        self.snaps[rank] = LoadSnapshot(dp_rank=rank, timestamp=ts, num_running_reqs=running,
                                        num_waiting_reqs=waiting, num_total_tokens=tokens)

    def __call__(self):
        self.reads += 1
        return list(self.snaps)


def item(tokens: int = 10, rank: int | None = None, room: int | None = None) -> DispatchItem:
    return DispatchItem(num_tokens=tokens, routed_dp_rank=rank, bootstrap_room=room)


def test_auto_resolution_and_prefill_guard():
    assert resolve_method("auto", "null") == ("round_robin", None)
    assert resolve_method("auto", "decode") == ("round_robin", None)
    assert resolve_method("auto", "prefill") == ("follow_bootstrap_room", None)
    method, warning = resolve_method("round_robin", "prefill")
    assert method == "follow_bootstrap_room" and "rendezvous" in warning
    assert resolve_method("total_tokens", "prefill") == ("total_tokens", None)
    with pytest.raises(ValueError):
        resolve_method("fastest", "null")


def test_round_robin_cycles_active_slots_only_and_skips_unavailable():
    d = Dispatcher("round_robin", num_slots=4, num_active=3)
    assert [d.dispatch(item()) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    d.set_state(1, SlotState.UNAVAILABLE)
    assert [d.dispatch(item()) for _ in range(4)] == [0, 2, 0, 2]
    d.set_state(3, SlotState.ACTIVE)  # elastic add
    assert sorted(d.dispatch(item()) for _ in range(3)) == [0, 2, 3]


def _all_reserved(method: str) -> Dispatcher:
    d = Dispatcher(method, 2, 1)
    d.set_state(0, SlotState.RESERVED)
    return d


def test_round_robin_full_lap_of_unavailable_is_503_and_recovers():
    d = Dispatcher("round_robin", 2, 2)
    d.set_state(0, SlotState.UNAVAILABLE)
    d.set_state(1, SlotState.UNAVAILABLE)
    with pytest.raises(DispatchError) as err:
        d.dispatch(item())
    assert err.value.status == 503
    d.set_state(1, SlotState.ACTIVE)
    assert d.dispatch(item()) == 1
    for method in ("round_robin", "total_requests", "total_tokens"):
        with pytest.raises(DispatchError) as err:  # every slot removed: a 503, not a crash
            _all_reserved(method).place(5)
        assert err.value.status == 503


def test_routed_rank_leaves_counter_and_budget_alone():
    d = Dispatcher("round_robin", 3, 3)
    d.dispatch(item())
    assert d.dispatch(item(rank=2)) == 2
    assert d.dispatch(item()) == 1  # the counter did not move
    t = Dispatcher("total_tokens", 3, 3)
    assert t.dispatch(item(tokens=100, rank=0)) == 0
    assert t.tokens == [0, 0, 0] and t.requests == [0, 0, 0]


def test_routed_rank_errors():
    d = Dispatcher("round_robin", 3, 2)
    for bad in (-1, 3):
        with pytest.raises(DispatchError) as err:
            d.dispatch(item(rank=bad))
        assert err.value.status == 400 and err.value.param == "routed_dp_rank"
    with pytest.raises(DispatchError) as err:
        d.dispatch(item(rank=2))  # reserved
    assert err.value.status == 503


def test_follow_bootstrap_room_counts_reserved_slots():
    d = Dispatcher("follow_bootstrap_room", num_slots=4, num_active=4)
    assert [d.dispatch(item(room=r)) for r in (0, 5, 10, 2**63 - 1)] == [0, 1, 2, 3]
    reserved = Dispatcher("follow_bootstrap_room", num_slots=4, num_active=3)
    assert reserved.dispatch(item(room=6)) == 2  # 6 % 4, not 6 % 3
    with pytest.raises(DispatchError) as err:
        reserved.dispatch(item(room=7))  # slot 3 is reserved
    assert err.value.status == 503
    with pytest.raises(DispatchError) as err:
        d.dispatch(item())
    assert err.value.status == 400 and "router" in err.value.message


def test_total_requests_ties_go_to_lowest_index_and_increments_spread():
    d = Dispatcher("total_requests", 3, 3)
    assert [d.dispatch(item()) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert d.requests == [2, 2, 2]


def test_total_tokens_is_lexicographic_on_tokens_then_requests():
    clock, board = FakeClock(), FakeBoard(3)
    board.set(0, 1.0, running=5, tokens=100)
    board.set(1, 1.0, running=1, tokens=100)
    board.set(2, 1.0, running=0, tokens=300)
    d = Dispatcher("total_tokens", 3, 3, read_loads=board, clock=clock)
    assert d.dispatch(item(tokens=50)) == 1  # tokens tie 100/100; fewer requests wins
    assert d.tokens == [100, 150, 300] and d.requests == [5, 2, 0]
    assert d.dispatch(item(tokens=50)) == 0


def test_refresh_is_throttled_and_ignores_unchanged_timestamps():
    clock, board = FakeClock(), FakeBoard(2)
    board.set(0, 1.0, running=10)
    board.set(1, 1.0, running=0)
    d = Dispatcher("total_requests", 2, 2, read_loads=board, refresh_interval=0.02, clock=clock)
    assert d.dispatch(item()) == 1
    clock.now = 0.01
    assert d.dispatch(item()) == 1 and board.reads == 1  # inside the window: no read
    assert d.requests == [10, 2]
    clock.now = 0.03
    d.dispatch(item())  # window over: read again, but timestamps unchanged -> keep budget
    assert board.reads == 2 and d.requests == [10, 3]
    board.set(1, 2.0, running=1)
    clock.now = 0.06
    d.dispatch(item())
    assert d.requests == [10, 2]  # rank 1 reset to its fresh snapshot (1), then +1


def test_batch_refreshes_once():
    clock, board = FakeClock(), FakeBoard(2)
    board.set(0, 1.0)
    board.set(1, 1.0)
    d = Dispatcher("total_requests", 2, 2, read_loads=board, refresh_interval=0.0, clock=clock)
    ranks = d.dispatch_batch([item() for _ in range(10)])
    assert board.reads == 1
    assert Counter(ranks) == {0: 5, 1: 5}


def test_burst_within_one_window_spreads_evenly_but_refresh_every_time_concentrates():
    """1,000 requests inside one refresh window: the speculative increments spread them;
    refreshing on every request (throttle 0) resets the budget from a board that has not
    changed yet, so the whole burst lands on the rank the board shows lightest."""

    def burst(refresh_interval: float) -> Counter:
        clock, board = FakeClock(), FakeBoard(4)
        stamp = [0.0]

        def fresh_board():
            # The schedulers republish often (new timestamps) but have not seen the burst.
            stamp[0] += 1
            for r, running in enumerate((3, 5, 4, 6)):
                board.set(r, stamp[0], running=running)
            return board()

        d = Dispatcher("total_requests", 4, 4, read_loads=fresh_board,
                       refresh_interval=refresh_interval, clock=clock)
        return Counter(d.dispatch(item()) for _ in range(1000))

    spread = burst(0.02)
    loads = {r: spread[r] + base for r, base in enumerate((3, 5, 4, 6))}
    assert max(loads.values()) - min(loads.values()) <= 1
    concentrated = burst(0.0)
    assert concentrated == {0: 1000}


def test_controller_frames_carry_the_routing_fields_apart_from_the_request():
    """The front end's messages to the controller: [header, request] or [headers, requests..];
    the header holds what `Dispatcher.place` needs, the request frame is what a scheduler reads."""
    import msgspec

    from common.messages import scheduler_input as si
    from common.messages.sampling import SamplingParams

    for n in (0, 5, 15, 16, 300, 70_000):
        req = si.GenerateRequest(rid="r", input_ids=list(range(n)), sampling=SamplingParams(),
                                 routed_dp_rank=2, bootstrap_room=9)
        head, body = si.controller_frames([req])
        assert si.route_decoder.decode(head) == si.RouteHeader("r", n, 2, 9)
        assert len(head) < 32  # independent of the prompt
        assert si.decoder.decode(body) == req  # the scheduler's own message
    reqs = [si.GenerateRequest(rid=f"b{i}", input_ids=[1] * i, sampling=SamplingParams())
            for i in range(3)]
    head, *bodies = si.controller_frames(reqs)
    assert si.batch_route_decoder.decode(head) == [si.RouteHeader(f"b{i}", i) for i in range(3)]
    assert [si.decoder.decode(b) for b in bodies] == reqs
    for msg in (si.AbortRequest(rid="r", dp_rank=1), si.FlushCacheRequest(request_id="f"),
                si.StatsRequest(request_id="s"), si.SetSlotState(dp_rank=0, state="active")):
        assert si.control_decoder.decode(si.encoder.encode(msg)) == msg
    with pytest.raises(msgspec.ValidationError):  # a request without its header frame
        si.control_decoder.decode(body)
    with pytest.raises(ValueError):
        si.controller_frames([])


def test_single_place_matches_batch_of_one_for_every_method():
    """`place` (the controller's hot path, cached slot lists) decides exactly as a batch of one,
    through state changes, routed ranks, errors and budget refreshes."""
    import random

    rng = random.Random(1)
    for method in ("round_robin", "follow_bootstrap_room", "total_requests", "total_tokens"):
        clock, board = FakeClock(), FakeBoard(5)
        for r in range(5):
            board.set(r, 1.0, running=rng.randrange(4), tokens=rng.randrange(500))
        one = Dispatcher(method, 5, 4, read_loads=board, clock=clock)
        batch = Dispatcher(method, 5, 4, read_loads=board, clock=clock)
        for step in range(400):
            if step % 50 == 25:
                slot, state = rng.randrange(5), rng.choice(list(SlotState))
                one.set_state(slot, state)
                batch.set_state(slot, state)
            if step % 40 == 0:
                clock.now += 0.05
                board.set(rng.randrange(5), clock.now, running=rng.randrange(6),
                          tokens=rng.randrange(800))
            it = item(tokens=rng.randrange(1, 300),
                      rank=rng.choice([None] * 6 + [0, 3, 7]),
                      room=rng.choice([None, rng.getrandbits(63)]))
            try:
                got = one.place(it.num_tokens, it.routed_dp_rank, it.bootstrap_room)
            except DispatchError as exc:
                got = ("error", exc.status, exc.message)
            [want] = batch.place_batch([it])
            if isinstance(want, DispatchError):
                want = ("error", want.status, want.message)
            assert got == want, (method, step)
            assert (one.requests, one.tokens, one.rr_counter) == (
                batch.requests, batch.tokens, batch.rr_counter)


# ---- the controller loop: forwarding and deferred DispatchReports --------------------------


class _Stop(BaseException):
    pass


@pytest.fixture
def controller(tmp_path, monkeypatch):
    """A real ControllerLoop (round robin, 3 ranks) in a thread, its peers bound here. Yields a
    factory: start(**report_settings) -> (push, schedulers, frontend)."""
    import threading

    import zmq

    import common.dp.controller as ctl
    from common.messages import scheduler_input as si

    ctx = zmq.Context()
    folder = str(tmp_path)
    ipc = _ipc(folder)
    scheds = []
    for rank in range(3):
        s = ctx.socket(zmq.PULL)
        s.bind(ipc.scheduler_input_of(rank))
        scheds.append(s)
    frontend = ctx.socket(zmq.PULL)
    frontend.bind(ipc.frontend_input)
    started = []

    stop = si.encoder.encode(si.StatsRequest(request_id="stop"))

    class StoppableLoop(ctl.ControllerLoop):
        def handle_control(self, raw):
            if raw == stop:
                raise _Stop
            super().handle_control(raw)

    def start(prequeued: list[list[bytes]] = (), dispatcher: Dispatcher | None = None,
              polled: bool = False, **settings):
        """polled: the loop of a controller that also owns the multi-node load relay."""
        for name, value in settings.items():
            monkeypatch.setattr(ctl, name, value)
        loop = StoppableLoop(dispatcher or Dispatcher("round_robin", 3, 3), ipc, ctx=ctx)
        if polled:  # a relay socket nobody sends to: the loop polls with zmq's Poller
            loop.relay = ctx.socket(zmq.PULL)
            loop.relay.bind(f"ipc://{folder}/relay")
            loop.poller = zmq.Poller()
            loop.poller.register(loop.listener.fileno(), zmq.POLLIN)
            loop.poller.register(loop.relay, zmq.POLLIN)
        push = _Feeder(ipc.controller_input)
        for frames in prequeued:
            push.send_multipart(frames)
        if prequeued:
            import time
            time.sleep(0.2)  # queued in the controller's socket before its loop starts

        def run():
            try:
                loop.run_forever()
            except _Stop:
                pass

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        started.append((push, thread, loop))
        return push, scheds, frontend

    yield start
    for push, thread, loop in started:
        push.send(stop)
        thread.join(5)
        assert not thread.is_alive()
        push.close()
        loop.listener.close()
    ctx.destroy(linger=0)


class _Feeder:
    """The front end's side of the controller's input, blocking (a test sends little)."""

    def __init__(self, path: str):
        from common.server import frame_stream

        self._stream = frame_stream
        self.sock = frame_stream.connect(path)

    def send_multipart(self, frames) -> None:
        self._stream.send_blocking(self.sock, frames)

    def send(self, raw: bytes) -> None:
        self._stream.send_blocking(self.sock, [raw])

    def close(self) -> None:
        self.sock.close()


def _ipc(folder):
    """A service tree's channel addresses in `folder` (the controller's input: a socket path)."""
    from common.server.ipc import IpcPaths

    return IpcPaths(folder=str(folder), controller_input=f"{folder}/ctl.sock",
                    detokenizer_input=f"ipc://{folder}/detok", frontend_input=f"ipc://{folder}/fe")


def _req(rid: str, **kw):
    from common.messages import scheduler_input as si
    from common.messages.sampling import SamplingParams

    return si.GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(), **kw)


def _gen(rid: str, **kw) -> list[bytes]:
    """What the front end sends the controller for one request: [header, request]."""
    from common.messages import scheduler_input as si

    return si.controller_frames([_req(rid, **kw)])


def _body(rid: str, **kw) -> bytes:
    """What a scheduler must receive for that request: the request frame alone."""
    from common.messages import scheduler_input as si

    return si.encoder.encode(_req(rid, **kw))


def _arrival(sock) -> list[bytes]:
    assert sock.poll(2000)
    return sock.recv_multipart()


def _reports(frontend, timeout_ms: int = 2000) -> list:
    from common.messages import frontend_input

    out = []
    while frontend.poll(timeout_ms):
        out.append(frontend_input.decoder.decode(frontend.recv()))
        timeout_ms = 50
    return out


@pytest.mark.parametrize("polled", [False, True])
def test_controller_forwards_at_once_and_reports_a_burst_in_one_message(controller, polled):
    msgs = [_gen(f"r{i}") for i in range(5)]
    # (a long delay: a stalled CI machine must not split the burst's report)
    push, scheds, frontend = controller(prequeued=msgs, polled=polled, REPORT_DELAY_MS=300)
    # The request frame alone, unchanged, round robin over the 3 ranks.
    for i in range(5):
        assert _arrival(scheds[i % 3]) == [_body(f"r{i}")]
    # The queued burst was handled back to back: one report, once the input went quiet.
    [report] = _reports(frontend)
    assert report.rids == [f"r{i}" for i in range(5)] and report.ranks == [0, 1, 2, 0, 1]
    assert report.failed == []
    push.send_multipart(_gen("later"))  # a lone request is reported too
    [report] = _reports(frontend)
    assert (report.rids, report.ranks) == (["later"], [2])


@pytest.mark.parametrize("polled", [False, True])
def test_controller_reports_failures_at_once_and_keeps_serving(controller, polled):
    push, scheds, frontend = controller(polled=polled, REPORT_DELAY_MS=60_000)
    push.send_multipart(_gen("ok"))
    push.send_multipart(_gen("bad", routed_dp_rank=7))
    [report] = _reports(frontend)  # the failure flushes what was pending with it
    assert report.rids == ["ok"] and report.ranks == [0]
    [failure] = report.failed
    assert (failure.rid, failure.status, failure.param) == ("bad", 400, "routed_dp_rank")
    push.send_multipart(_gen("after"))
    assert _arrival(scheds[1]) == [_body("after")]


def test_controller_report_waits_at_most_max_items(controller):
    push, scheds, frontend = controller(REPORT_DELAY_MS=60_000, REPORT_MAX_ITEMS=3)
    for i in range(4):
        push.send_multipart(_gen(f"n{i}"))
    [report] = _reports(frontend)  # the first 3: the item cap; n3 waits (60 s)
    assert report.rids == ["n0", "n1", "n2"]


def test_controller_report_is_bounded_in_time_under_a_trickle(controller):
    """Requests closer together than the delay still get reported: by age, after a forward."""
    import time

    push, scheds, frontend = controller(REPORT_DELAY_MS=100)
    t0 = time.monotonic()
    for rid in ("a", "b", "c", "d"):
        push.send_multipart(_gen(rid))
        time.sleep(0.04)
    reports = _reports(frontend)
    assert [rid for r in reports for rid in r.rids] == ["a", "b", "c", "d"]
    assert len(reports) < 4  # batched
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("polled", [False, True])
def test_controller_places_a_batch_with_one_refresh_and_forwards_each_request(controller,
                                                                               polled):
    from common.messages import scheduler_input as si

    board = FakeBoard(3)
    for r in range(3):
        board.set(r, 1.0)
    dispatcher = Dispatcher("total_tokens", 3, 3, read_loads=board, refresh_interval=0.0)
    push, scheds, frontend = controller(dispatcher=dispatcher, polled=polled,
                                        REPORT_DELAY_MS=60_000, REPORT_MAX_ITEMS=4)
    reqs = [_req("t0"), _req("t1"), _req("pinned", routed_dp_rank=0), _req("t3")]
    reqs[0] = si.GenerateRequest(rid="t0", input_ids=[7] * 500, sampling=reqs[0].sampling)
    push.send_multipart(si.controller_frames(reqs))
    [report] = _reports(frontend)
    assert board.reads == 1  # one budget refresh for the whole batch
    # total_tokens: t0 (500 tokens) -> 0, t1 -> 1, pinned -> 0 (no budget change), t3 -> 2.
    assert report.rids == ["t0", "t1", "pinned", "t3"] and report.ranks == [0, 1, 0, 2]
    assert _arrival(scheds[0]) == [si.encoder.encode(reqs[0])]
    assert _arrival(scheds[0]) == [si.encoder.encode(reqs[2])]
    assert _arrival(scheds[1]) == [si.encoder.encode(reqs[1])]
    assert _arrival(scheds[2]) == [si.encoder.encode(reqs[3])]
    assert dispatcher.tokens == [500, 3, 3]


def test_controller_control_messages_stay_single_frames(controller):
    import zmq

    from common.messages import scheduler_input as si

    push, scheds, frontend = controller(REPORT_DELAY_MS=60_000)
    abort = si.encoder.encode(si.AbortRequest(rid="x", dp_rank=2))
    push.send(abort)
    assert _arrival(scheds[2]) == [abort]
    push.send(si.encoder.encode(si.SetSlotState(dp_rank=1, state="unavailable")))
    for raw in (si.encoder.encode(si.AbortRequest(rid="y")),
                si.encoder.encode(si.FlushCacheRequest(request_id="f")),
                si.encoder.encode(si.StatsRequest(request_id="s"))):
        push.send(raw)
        for rank in (0, 2):  # every started rank, not the unavailable one
            assert _arrival(scheds[rank]) == [raw]
    push.send_multipart(_gen("a"))
    push.send_multipart(_gen("b"))
    assert _arrival(scheds[0]) == [_body("a")]
    assert _arrival(scheds[2]) == [_body("b")]  # round robin skips rank 1
    assert scheds[1].poll(100, zmq.POLLIN) == 0


@pytest.mark.parametrize("polled", [False, True])
def test_controller_drops_malformed_messages_and_keeps_serving(controller, polled, caplog):
    from common.messages import scheduler_input as si

    push, scheds, frontend = controller(polled=polled, REPORT_DELAY_MS=60_000)
    push.send(_body("no-header"))  # a request without its header frame: dropped, logged
    push.send_multipart([b"\xc1", _body("junk")])  # an undecodable header
    head, *bodies = si.controller_frames([_req("m0"), _req("m1")])
    push.send_multipart([head, bodies[0]] + bodies)  # 2 headers, 3 requests: both fail
    [report] = _reports(frontend)
    assert [(f.rid, f.status) for f in report.failed] == [("m0", 500), ("m1", 500)]
    push.send_multipart(_gen("fine"))
    assert _arrival(scheds[0]) == [_body("fine")]
    assert "malformed" in caplog.text


async def test_front_end_sends_header_frames_to_a_controller_and_plain_frames_otherwise(
        tmp_path):
    import select

    import zmq

    from common.messages import scheduler_input as si
    from common.server import frame_stream
    from common.server.frontend import FrontEnd

    one, batch = [_req("one")], [_req("b0"), _req("b1", bootstrap_room=5)]
    ctx = zmq.Context()
    try:
        # No controller: plain single frames on the scheduler's ZMQ PULL.
        ipc = _ipc(tmp_path)
        sink = ctx.socket(zmq.PULL)
        sink.bind(ipc.scheduler_input_of(0))
        fe = FrontEnd(ipc, ipc.scheduler_input_of(0))
        try:
            fe.generate_many(one)
            fe.generate_many(batch)
            got = [_arrival(sink) for _ in range(3)]
            assert got == [[si.encoder.encode(r)] for r in one + batch]
        finally:
            await fe.close()
            sink.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    # A controller: one message per HTTP request on its stream socket, header frame(s) first.
    listener = frame_stream.listen(ipc.controller_input)
    fe = FrontEnd(ipc, ipc.controller_input, 3, via_controller=True)
    conn, _ = listener.accept()
    reader = frame_stream.FrameReader(conn)
    try:
        fe.generate_many(one)
        fe.generate_many(batch)
        fe.abort("one")
        got = []
        while len(got) < 3:
            assert select.select([conn], [], [], 2)[0]
            got += [[bytes(f) for f in msg] for msg in reader.read()]
        assert got == [si.controller_frames(one), si.controller_frames(batch),
                       [si.encoder.encode(si.AbortRequest(rid="one",
                                                          message="aborted by request"))]]
    finally:
        await fe.close()
        conn.close()
        listener.close()


def test_controller_drops_a_corrupt_connection_and_serves_the_others(controller, caplog):
    push, scheds, frontend = controller(REPORT_DELAY_MS=60_000)
    other = _Feeder(push.sock.getpeername())
    try:
        other.sock.sendall(b"\xff\xff\xff\xff\x00\x00")  # a length no message has
        push.send_multipart(_gen("fine"))
        assert _arrival(scheds[0]) == [_body("fine")]
        import time

        deadline = time.monotonic() + 5
        while "corrupt stream" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "corrupt stream" in caplog.text
    finally:
        other.close()


async def test_front_end_fails_requests_with_503_when_the_controller_is_gone(tmp_path):
    import asyncio

    from common.server import frame_stream
    from common.server.frontend import FrontEnd

    ipc = _ipc(tmp_path)
    listener = frame_stream.listen(ipc.controller_input)
    fe = FrontEnd(ipc, ipc.controller_input, 3, via_controller=True)
    conn, _ = listener.accept()
    conn.close()  # the controller died
    listener.close()
    try:
        outs = []
        for i in range(200):  # the first sends may still fit in the kernel's buffer
            [it] = fe.generate_many([_req(f"r{i}")])
            if fe.to_controller.error is not None:
                outs.append(await anext(it))
                break
            await asyncio.sleep(0.005)
        [out] = outs
        assert out.finished and out.finish_reason.status == 503
        assert "DP controller channel is closed" in out.finish_reason.message
        fe.abort("r0")  # aborting on a dead channel is not an error
    finally:
        await fe.close()


async def test_front_end_fails_a_request_still_queued_when_the_controller_goes(tmp_path):
    """A request too big for the socket buffer waits in the sender's backlog; the controller
    dies before reading it: the request fails with 503 (it is not left waiting forever)."""
    import asyncio

    from common.messages import scheduler_input as si
    from common.messages.sampling import SamplingParams
    from common.server import frame_stream
    from common.server.frontend import FrontEnd

    ipc = _ipc(tmp_path)
    listener = frame_stream.listen(ipc.controller_input)
    fe = FrontEnd(ipc, ipc.controller_input, 3, via_controller=True)
    conn, _ = listener.accept()
    try:
        huge = si.GenerateRequest(rid="huge", input_ids=list(range(100_000, 400_000)),
                                  sampling=SamplingParams())
        [it] = fe.generate_many([huge])
        assert fe.to_controller.backlog_bytes > 0
        conn.close()
        out = await asyncio.wait_for(anext(it), 5)
        assert out.finished and out.finish_reason.status == 503
        assert "DP controller channel is closed" in out.finish_reason.message
    finally:
        await fe.close()
        listener.close()


def test_controller_serves_a_front_end_that_reconnects(controller):
    from common.server import frame_stream

    push, scheds, frontend = controller(REPORT_DELAY_MS=60_000)
    push.send_multipart(_gen("first"))
    assert _arrival(scheds[0]) == [_body("first")]
    path = push.sock.getpeername()
    push.sock.close()  # the controller sees the connection close ...
    push.sock = frame_stream.connect(path)  # ... and serves the next one
    push.send_multipart(_gen("again"))
    assert _arrival(scheds[1]) == [_body("again")]


async def test_front_end_refuses_a_message_over_the_channel_limit_and_forgets_it(tmp_path,
                                                                                 monkeypatch):
    """Too big for the controller channel: that request alone gets a 413, and its state is
    released (its rid is free again); the channel keeps working."""
    import asyncio

    from common.server import frame_stream
    from common.server.frontend import FrontEnd

    ipc = _ipc(tmp_path)
    listener = frame_stream.listen(ipc.controller_input)
    fe = FrontEnd(ipc, ipc.controller_input, 3, via_controller=True)
    conn, _ = listener.accept()
    reader = frame_stream.FrameReader(conn)
    monkeypatch.setattr(frame_stream, "MAX_MESSAGE_BYTES", 2_000)
    try:
        from common.messages import scheduler_input as si
        from common.messages.sampling import SamplingParams

        big = si.GenerateRequest(rid="big", input_ids=list(range(5_000)),
                                 sampling=SamplingParams())
        [it] = fe.generate_many([big])
        out = await asyncio.wait_for(anext(it), 5)
        assert out.finished and out.finish_reason.status == 413
        assert "request too large" in out.finish_reason.message
        await it.aclose()
        assert not fe.is_inflight("big") and fe.fatal_reason is None
        fe.generate_many([_req("small")])
        import select

        assert select.select([conn], [], [], 2)[0]
        [[head, body]] = reader.read()
        assert bytes(body) == _body("small")
    finally:
        await fe.close()
        conn.close()
        listener.close()


async def test_front_end_control_sends_never_raise_once_the_channel_broke(tmp_path):
    """The watchdog marks dead ranks through send_control: a broken channel must not raise
    there; control calls fail with a clear error; the front end says the service is done."""
    import asyncio

    from common.messages import scheduler_input as si
    from common.server import frame_stream
    from common.server.frontend import FrontEnd

    ipc = _ipc(tmp_path)
    listener = frame_stream.listen(ipc.controller_input)
    fe = FrontEnd(ipc, ipc.controller_input, 3, via_controller=True)
    conn, _ = listener.accept()
    conn.close()
    listener.close()
    try:
        for _ in range(200):  # until a write notices the closed peer
            if not fe.send_control(si.SetSlotState(dp_rank=1, state="unavailable")):
                break
            await asyncio.sleep(0.005)
        assert fe.fatal_reason is not None and "DP controller channel" in fe.fatal_reason
        assert fe.send_control(si.SetSlotState(dp_rank=2, state="unavailable")) is False
        with pytest.raises(RuntimeError):
            await fe.stats()
    finally:
        await fe.close()


def test_controller_survives_messages_it_cannot_handle(controller, caplog):
    """An abort naming a rank that does not exist goes to every started rank; a slot state
    message with an unknown state is logged and dropped; serving goes on."""
    from common.messages import scheduler_input as si

    push, scheds, frontend = controller(REPORT_DELAY_MS=60_000)
    abort = si.encoder.encode(si.AbortRequest(rid="x", dp_rank=7))
    push.send(abort)
    for rank in range(3):
        assert _arrival(scheds[rank]) == [abort]
    push.send(si.encoder.encode(si.SetSlotState(dp_rank=1, state="sideways")))
    push.send_multipart(_gen("still"))
    assert _arrival(scheds[0]) == [_body("still")]
    assert "dropped a message from the front end" in caplog.text
