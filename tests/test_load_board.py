"""The shared-memory load board: layout checks, torn-read freedom, stale boards."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from common.loads.board import HEADER, BoardError, LoadBoard
from common.loads.snapshot import LoadSnapshot


@pytest.fixture
def board(tmp_path):
    b = LoadBoard.create(3, directory=str(tmp_path))
    yield b
    b.unlink()


def snap(rank: int, i: int) -> LoadSnapshot:
    # Every field derived from i: a torn read would mix two values of i.
    return LoadSnapshot(dp_rank=rank, timestamp=float(i), num_running_reqs=i, num_waiting_reqs=i,
                        num_used_tokens=i * 3, num_total_tokens=i * 3, num_active_tokens=i * 3,
                        max_total_num_tokens=10**9, token_usage=i / 1e9)


def test_write_read_and_empty_slots(board):
    assert board.read_all() == [None, None, None]
    board.write(snap(1, 7))
    other = LoadBoard.attach(board.path, 3, board.board_id)
    assert other.read(1) == snap(1, 7)
    assert other.read(0) is None
    other.close()


def test_foreign_stale_and_mismatched_boards_are_refused(board, tmp_path):
    with pytest.raises(BoardError, match="stale board id"):
        LoadBoard.attach(board.path, 3, board.board_id + 1)
    with pytest.raises(BoardError, match="dp_size"):
        LoadBoard.attach(board.path, 4, board.board_id)
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 1024)
    with pytest.raises(BoardError, match="not a pdserve load board"):
        LoadBoard.attach(str(junk), 3, board.board_id)
    with pytest.raises(BoardError, match="does not exist"):
        LoadBoard.attach(str(tmp_path / "missing"), 3, 1)
    old = bytearray(junk.read_bytes())
    HEADER.pack_into(old, 0, b"PDLOADS\0", 99, 3, 256, 0, 5)
    junk.write_bytes(bytes(old))
    with pytest.raises(BoardError, match="version"):
        LoadBoard.attach(str(junk), 3, 5)


def test_unlink_removes_the_file(tmp_path):
    b = LoadBoard.create(1, directory=str(tmp_path))
    assert os.path.exists(b.path)
    b.unlink()
    assert not os.path.exists(b.path)


def _hammer_writer(path: str, board_id: int, seconds: float) -> None:
    b = LoadBoard.attach(path, 3, board_id)
    deadline = time.monotonic() + seconds
    i = 1
    while time.monotonic() < deadline:
        b.write(snap(2, i))
        i += 1


def test_concurrent_reader_never_sees_a_torn_slot(board):
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_hammer_writer, args=(board.path, board.board_id, 1.5))
    writer.start()
    try:
        reads, last = 0, 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            s = board.read(2)
            if s is None:
                continue
            i = s.num_running_reqs
            assert s == snap(2, i), "torn read"
            assert i >= last, "went back in time"
            last, reads = i, reads + 1
        assert reads > 1000 and last > 1000
    finally:
        writer.join(10)
    assert writer.exitcode == 0
