"""Multi-node load relay: ranks on other nodes PUSH their snapshots to node 0 over ZMQ, and
exactly one process there (the controller for load-aware methods, else the front end) PULLs
them and writes them into node 0's board, so every reader on node 0 sees all ranks."""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from common.loads.board import LoadBoard
from common.loads.snapshot import LoadSnapshot, decoder, encoder

logger = logging.getLogger(__name__)


class RelayPublisher:
    """A remote rank's side: publish() sends a snapshot to node 0 (never blocks)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 16)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def publish(self, snap: LoadSnapshot) -> None:
        try:
            self.sock.send(encoder.encode(snap), zmq.NOBLOCK)
        except zmq.Again:
            pass  # node 0 is not reading: a later snapshot supersedes this one anyway


def write_relayed(board: LoadBoard, raw: bytes) -> None:
    """Store one relayed snapshot; a malformed or out-of-range one is logged and dropped."""
    try:
        snap = decoder.decode(raw)
        board.write(snap)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError, ValueError) as exc:
        logger.warning("dropped a relayed load snapshot: %s", exc)


def bind_relay(ctx: zmq.Context | zmq.asyncio.Context, endpoint: str):
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


async def relay_forever(sock: zmq.asyncio.Socket, board: LoadBoard) -> None:
    """The front end's relay task (when the controller does not own the PULL)."""
    while True:
        write_relayed(board, await sock.recv())
