"""Helpers every child process of the service tree uses: logging, dying with the parent,
and reporting start-up to the launcher."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from common.messages import launch

PR_SET_PDEATHSIG = 1


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def die_with_parent() -> None:
    """The kernel kills this child when the launcher dies, however it dies; Ctrl-C is left to
    the launcher, which stops the children in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def report(conn: Connection, message: launch.LaunchMessage) -> None:
    conn.send_bytes(launch.encoder.encode(message))
    conn.close()
