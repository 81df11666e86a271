"""The load board: one shared-memory file per service, one fixed slot per DP rank.

Layout (little endian):
    header  magic b"PDLOADS\\0" | version u32 | dp_size u32 | slot_size u32 | pad u32 |
            board_id u64 (random, shared by every process of one service tree)
    slot k  at HEADER_SIZE + k * slot_size:
            sequence u64 | length u32 | pad u32 | payload (msgpack LoadSnapshot)

Writers use a sequence lock: the sequence is odd while a slot is being written and even once
it is complete. A reader copies the slot and accepts it only if the sequence was even and
unchanged across the copy, so it never sees a torn snapshot; it retries otherwise. Each slot
has exactly one writer (its rank, or the multi-node relay on node 0).

Lifecycle: the launcher `create`s the board (a file under /dev/shm) before starting the
children, which `attach` with the board id they were given: a file with a wrong magic, version,
dp_size or id (a stale board from an earlier run, or another service's) is refused with a
`BoardError` instead of being misread. The launcher `unlink`s it on shutdown.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import tempfile
from pathlib import Path

from common.loads.snapshot import LoadSnapshot, decoder, encoder

MAGIC = b"PDLOADS\0"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ")
HEADER_SIZE = 64
SLOT_HEADER = struct.Struct("<QII")
SLOT_SIZE = 256
MAX_READ_RETRIES = 100_000


class BoardError(RuntimeError):
    """The file is not the board this process expects."""


def default_board_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class LoadBoard:
    def __init__(self, path: str, mm: mmap.mmap, dp_size: int, board_id: int, owner: bool):
        self.path = path
        self._mm = mm
        self.dp_size = dp_size
        self.board_id = board_id
        self.owner = owner

    # ---- lifecycle -----------------------------------------------------------------------
    @classmethod
    def create(cls, dp_size: int, directory: str | None = None) -> LoadBoard:
        board_id = secrets.randbits(63)
        path = os.path.join(directory or default_board_dir(), f"pdserve-loads-{board_id:x}")
        size = HEADER_SIZE + dp_size * SLOT_SIZE
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        HEADER.pack_into(mm, 0, MAGIC, VERSION, dp_size, SLOT_SIZE, 0, board_id)
        return cls(path, mm, dp_size, board_id, owner=True)

    @classmethod
    def attach(cls, path: str, dp_size: int, board_id: int) -> LoadBoard:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise BoardError(f"load board {path} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise BoardError(f"{path} is too small to be a load board")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, found_dp, slot_size, _, found_id = HEADER.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = "is not a pdserve load board"
        elif version != VERSION:
            problem = f"has version {version}, expected {VERSION}"
        elif found_id != board_id:
            problem = "belongs to another service (stale board id)"
        elif found_dp != dp_size or slot_size != SLOT_SIZE:
            problem = f"has dp_size {found_dp}, expected {dp_size}"
        elif size < HEADER_SIZE + dp_size * SLOT_SIZE:
            problem = "is truncated"
        if problem:
            mm.close()
            raise BoardError(f"load board {path} {problem}")
        return cls(path, mm, dp_size, board_id, owner=False)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()

    def unlink(self) -> None:
        self.close()
        Path(self.path).unlink(missing_ok=True)

    # ---- slots -------------------------------------------------------------------------
    def _offset(self, rank: int) -> int:
        if not 0 <= rank < self.dp_size:
            raise IndexError(f"dp_rank {rank} outside [0, {self.dp_size})")
        return HEADER_SIZE + rank * SLOT_SIZE

    def write(self, snap: LoadSnapshot) -> None:
        payload = encoder.encode(snap)
        if len(payload) > SLOT_SIZE - SLOT_HEADER.size:
            raise ValueError(f"snapshot of {len(payload)} bytes does not fit a slot")
        offset = self._offset(snap.dp_rank)
        seq = struct.unpack_from("<Q", self._mm, offset)[0]
        struct.pack_into("<Q", self._mm, offset, seq + 1)  # odd: writing
        start = offset + SLOT_HEADER.size
        self._mm[start : start + len(payload)] = payload
        struct.pack_into("<I", self._mm, offset + 8, len(payload))
        struct.pack_into("<Q", self._mm, offset, seq + 2)  # even: complete

    def read(self, rank: int) -> LoadSnapshot | None:
        """The rank's latest complete snapshot, or None if it never published."""
        offset = self._offset(rank)
        for _ in range(MAX_READ_RETRIES):
            before = struct.unpack_from("<Q", self._mm, offset)[0]
            if before & 1:
                os.sched_yield()  # let the writer finish its few microseconds
                continue
            length = struct.unpack_from("<I", self._mm, offset + 8)[0]
            start = offset + SLOT_HEADER.size
            payload = self._mm[start : start + length]
            after = struct.unpack_from("<Q", self._mm, offset)[0]
            if before == after:
                return decoder.decode(payload) if before else None
            os.sched_yield()
        raise BoardError(f"slot {rank} of {self.path} kept changing while being read")

    def read_all(self) -> list[LoadSnapshot | None]:
        return [self.read(r) for r in range(self.dp_size)]
