"""Transfer states and page-run coalescing."""

from __future__ import annotations

import pytest

from common.transfer.base import KVLayout, KVPoll, PageRun, TransferState, contiguous_runs


def test_runs_are_contiguous_on_both_sides():
    assert contiguous_runs([], []) == []
    assert contiguous_runs([4, 5, 6], [10, 11, 12]) == [PageRun(4, 10, 3)]
    assert contiguous_runs([4, 5, 6, 9], [10, 11, 20, 21]) == [
        PageRun(4, 10, 2), PageRun(6, 20, 1), PageRun(9, 21, 1)]
    assert contiguous_runs([3, 2, 1], [1, 2, 3]) == [PageRun(3, 1, 1), PageRun(2, 2, 1),
                                                     PageRun(1, 3, 1)]
    with pytest.raises(ValueError):
        contiguous_runs([1, 2], [1])


def test_states_only_move_forward_and_failed_is_sticky():
    s = TransferState()
    s.advance(KVPoll.Transferring)
    s.advance(KVPoll.WaitingForInput)
    assert s.state is KVPoll.Transferring
    s.fail("peer died")
    s.advance(KVPoll.Success)
    assert s.state is KVPoll.Failed and s.reason == "peer died"
    done = TransferState()
    done.advance(KVPoll.Success)
    done.fail("late")
    assert done.state is KVPoll.Success


def test_layout_mismatch_names_the_field():
    a = KVLayout(2, 16, 2, 16, "float32")
    a.check_compatible(KVLayout(2, 16, 2, 16, "float32"))
    with pytest.raises(ValueError, match="page_size"):
        a.check_compatible(KVLayout(2, 1, 2, 16, "float32"))
