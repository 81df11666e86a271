"""Addresses of the ZMQ channels inside one service tree (IPC sockets in a private folder)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class IpcPaths:
    folder: str
    scheduler_input: str  # front end -> scheduler
    detokenizer_input: str  # scheduler -> detokenizer
    frontend_input: str  # detokenizer -> front end

    @classmethod
    def create(cls) -> IpcPaths:
        folder = tempfile.mkdtemp(prefix="pdserve-")
        return cls(
            folder=folder,
            scheduler_input=f"ipc://{folder}/scheduler",
            detokenizer_input=f"ipc://{folder}/detokenizer",
            frontend_input=f"ipc://{folder}/frontend",
        )

    def remove(self) -> None:
        if Path(self.folder).exists():
            shutil.rmtree(self.folder, ignore_errors=True)
