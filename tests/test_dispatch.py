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


def test_round_robin_full_lap_of_unavailable_is_503_and_recovers():
    d = Dispatcher("round_robin", 2, 2)
    d.set_state(0, SlotState.UNAVAILABLE)
    d.set_state(1, SlotState.UNAVAILABLE)
    with pytest.raises(DispatchError) as err:
        d.dispatch(item())
    assert err.value.status == 503
    d.set_state(1, SlotState.ACTIVE)
    assert d.dispatch(item()) == 1


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


def test_controller_reads_routing_fields_without_decoding_prompts():
    import msgspec

    from common.messages import scheduler_input as si
    from common.messages.sampling import SamplingParams

    for n in (0, 5, 15, 16, 300, 70_000):
        req = si.GenerateRequest(rid="r", input_ids=list(range(n)), sampling=SamplingParams(),
                                 routed_dp_rank=2, bootstrap_room=9)
        raw = si.encoder.encode(req)
        view = si.controller_decoder.decode(raw)
        assert isinstance(view, si.RoutedGenerate)
        assert (view.rid, view.routed_dp_rank, view.bootstrap_room) == ("r", 2, 9)
        assert si.encoded_array_len(view.input_ids) == n
        assert si.decoder.decode(raw) == req  # forwarded bytes are the original request
    batch = si.controller_decoder.decode(si.encoder.encode(si.GenerateBatch(requests=[req, req])))
    assert isinstance(batch, si.RoutedBatch)
    assert si.decoder.decode(bytes(batch.requests[1])) == req
    assert isinstance(si.controller_decoder.decode(si.encoder.encode(si.AbortRequest(rid="r"))),
                      si.AbortRequest)
    with pytest.raises(ValueError):
        si.encoded_array_len(msgspec.msgpack.decode(msgspec.msgpack.encode(3), type=msgspec.Raw))
