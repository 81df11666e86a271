"""Liveness of DP ranks on other nodes, as node 0 judges it (`DpRanks.check_remote_ranks`):
silence for --remote-rank-timeout marks a rank unavailable and fails its requests; snapshots
moving again bring it back. Only timestamp changes count, on node 0's own clock."""

from __future__ import annotations

from common.dp.dispatch import SlotState
from common.loads.snapshot import LoadSnapshot
from common.server.dp_ranks import DpRanks


class FakeBoard:
    def __init__(self, n: int):
        self.snaps: list[LoadSnapshot | None] = [None] * n

    def publish(self, rank: int, timestamp: float, incarnation: int = 0) -> None:
        self.snaps[rank] = LoadSnapshot(dp_rank=rank, timestamp=timestamp,
                                        incarnation=incarnation)

    def read(self, rank: int) -> LoadSnapshot | None:
        if self.snaps[rank] == "torn":
            from common.loads.board import BoardError

            raise BoardError(f"slot {rank} kept changing while being read")
        return self.snaps[rank]


class FakeFrontEnd:
    def __init__(self, n: int):
        self.live_ranks = set(range(n))
        self.failed: list[tuple[int, str]] = []
        self.sent: list = []

    def fail_rank(self, rank: int, reason: str) -> None:
        self.live_ranks.discard(rank)
        self.failed.append((rank, reason))

    def fail_requests_of(self, rank: int, reason: str) -> int:
        self.failed.append((rank, reason))
        return 1

    def send_control(self, msg) -> bool:
        self.sent.append(msg)
        return True


def _ranks(n: int = 4, remote=(1,)) -> tuple[DpRanks, FakeBoard, FakeFrontEnd]:
    board, fe = FakeBoard(n), FakeFrontEnd(n)
    started = []
    dp = DpRanks(method="round_robin", num_active=n, num_slots=n, board=board, frontend=fe,
                 uses_controller=True, start_scheduler=started.append,
                 is_running=lambda r: False, remote_ranks=frozenset(remote))
    fe.started = started  # what activate() started on this node
    return dp, board, fe


def test_a_silent_remote_rank_is_marked_unavailable_after_the_timeout():
    dp, board, fe = _ranks(remote=(2, 3))
    for rank in range(4):
        board.publish(rank, 1000.0)
    dp.check_remote_ranks(timeout=5.0, now=0.0)
    board.publish(2, 1001.0)  # rank 2 keeps publishing, rank 3 went quiet
    dp.check_remote_ranks(timeout=5.0, now=4.0)
    assert dp.states == [SlotState.ACTIVE] * 4 and fe.failed == []
    board.publish(2, 1002.0)
    dp.check_remote_ranks(timeout=5.0, now=5.5)
    assert dp.states[3] is SlotState.UNAVAILABLE and dp.states[2] is SlotState.ACTIVE
    [(rank, reason)] = fe.failed
    assert rank == 3 and "no load snapshot for 5 s" in reason
    assert fe.sent[-1].dp_rank == 3 and fe.sent[-1].state == "unavailable"
    dp.check_remote_ranks(timeout=5.0, now=20.0)  # reported once, not again
    assert [r for r, _ in fe.failed] == [3, 2]  # (rank 2 went quiet in the meantime too)


def test_a_rank_that_never_published_counts_from_the_first_check():
    dp, board, fe = _ranks(2, remote=(1,))
    dp.check_remote_ranks(timeout=3.0, now=100.0)
    dp.check_remote_ranks(timeout=3.0, now=102.9)
    assert dp.states[1] is SlotState.ACTIVE
    dp.check_remote_ranks(timeout=3.0, now=103.1)
    assert dp.states[1] is SlotState.UNAVAILABLE


def test_a_lost_rank_comes_back_when_its_snapshots_move_again():
    dp, board, fe = _ranks(2, remote=(1,))
    board.publish(1, 50.0)
    dp.check_remote_ranks(timeout=1.0, now=0.0)
    dp.check_remote_ranks(timeout=1.0, now=2.0)
    assert dp.states[1] is SlotState.UNAVAILABLE and 1 not in fe.live_ranks
    dp.check_remote_ranks(timeout=1.0, now=3.0)  # still silent: still out
    assert dp.states[1] is SlotState.UNAVAILABLE
    board.publish(1, 49.0)  # a restarted node; its clock need not be ahead of the old one
    dp.check_remote_ranks(timeout=1.0, now=3.5)
    assert dp.states[1] is SlotState.ACTIVE and 1 in fe.live_ranks
    assert fe.sent[-1].state == "active"


def test_removed_ranks_are_not_judged_and_do_not_come_back_by_themselves():
    dp, board, fe = _ranks(2, remote=(1,))
    dp.states[1] = SlotState.RESERVED  # removed by the operator
    dp.check_remote_ranks(timeout=1.0, now=0.0)
    dp.check_remote_ranks(timeout=1.0, now=5.0)
    board.publish(1, 7.0)
    dp.check_remote_ranks(timeout=1.0, now=6.0)
    assert dp.states[1] is SlotState.RESERVED and fe.failed == [] and fe.sent == []


def test_the_timeout_flag_is_checked():
    import pytest

    from common.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="--remote-rank-timeout must be > 0"):
        ServerArgs(remote_rank_timeout=0)
    assert ServerArgs().remote_rank_timeout == 30.0


def test_a_torn_slot_is_judged_next_time_not_an_error():
    dp, board, fe = _ranks(2, remote=(1,))
    board.publish(1, 5.0)
    dp.check_remote_ranks(timeout=1.0, now=0.0)
    board.snaps[1] = "torn"
    dp.check_remote_ranks(timeout=1.0, now=0.5)  # no exception: skipped this round
    board.publish(1, 6.0)
    dp.check_remote_ranks(timeout=1.0, now=1.8)
    assert dp.states[1] is SlotState.ACTIVE


async def test_operators_can_remove_a_lost_remote_rank_and_bring_it_back():
    """Removing a lost rank keeps it out even when its node returns; activating a remote rank
    starts nothing on this node and gives it a full timeout to show up."""
    dp, board, fe = _ranks(2, remote=(1,))
    dp.check_remote_ranks(timeout=1.0, now=0.0)
    dp.check_remote_ranks(timeout=1.0, now=2.0)
    assert dp.states[1] is SlotState.UNAVAILABLE
    await dp.deactivate(1)
    assert dp.states[1] is SlotState.RESERVED
    board.publish(1, 3.0)  # the node is back, but the operator removed the rank
    dp.check_remote_ranks(timeout=1.0, now=3.0)
    assert dp.states[1] is SlotState.RESERVED
    await dp.activate(1)
    assert dp.states[1] is SlotState.ACTIVE and fe.started == []
    dp.check_remote_ranks(timeout=1.0, now=3.5)  # a fresh window, then judged again
    dp.check_remote_ranks(timeout=1.0, now=4.0)
    assert dp.states[1] is SlotState.ACTIVE
    dp.check_remote_ranks(timeout=1.0, now=4.6)
    assert dp.states[1] is SlotState.UNAVAILABLE


def test_a_remote_rank_that_restarted_within_the_timeout_loses_its_requests_not_its_slot():
    dp, board, fe = _ranks(2, remote=(1,))
    board.publish(1, 10.0, incarnation=7)
    dp.check_remote_ranks(timeout=30.0, now=0.0)
    board.publish(1, 11.0, incarnation=7)
    dp.check_remote_ranks(timeout=30.0, now=1.0)
    assert fe.failed == []
    board.publish(1, 12.0, incarnation=9)  # a new scheduler process, long before the timeout
    dp.check_remote_ranks(timeout=30.0, now=2.0)
    [(rank, reason)] = fe.failed
    assert rank == 1 and "restarted" in reason
    assert dp.states[1] is SlotState.ACTIVE and 1 in fe.live_ranks and fe.sent == []
    board.publish(1, 13.0, incarnation=9)
    dp.check_remote_ranks(timeout=30.0, now=3.0)
    assert len(fe.failed) == 1
