"""Addresses of the channels inside one service tree (IPC sockets in a private folder): ZMQ
endpoints, and the path of the front end -> DP controller Unix stream socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq


@dataclass(frozen=True, slots=True)
class IpcPaths:
    folder: str
    controller_input: str  # front end -> DP controller (dp_size > 1): a socket path, not ZMQ
    detokenizer_input: str  # schedulers -> detokenizer
    frontend_input: str  # detokenizer and controller -> front end

    @classmethod
    def create(cls) -> IpcPaths:
        folder = tempfile.mkdtemp(prefix="pdserve-")
        return cls(
            folder=folder,
            controller_input=f"{folder}/controller.sock",
            detokenizer_input=f"ipc://{folder}/detokenizer",
            frontend_input=f"ipc://{folder}/frontend",
        )

    def scheduler_input_of(self, dp_rank: int) -> str:
        """front end (dp_size 1) or DP controller -> the scheduler of one rank"""
        return f"ipc://{self.folder}/scheduler-{dp_rank}"

    def remove(self) -> None:
        if Path(self.folder).exists():
            shutil.rmtree(self.folder, ignore_errors=True)


def drain_nowait(sock: zmq.Socket) -> Iterator[bytes]:
    """Every message already queued on `sock`, without blocking."""
    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
