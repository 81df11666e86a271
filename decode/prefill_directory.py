"""Decode's cache of prefill topologies, one per bootstrap server (host, port).

Lifecycle of an entry:
    lookup(host, port) creates it: PENDING, and wakes the background thread
    GET /route -> 200 and a compatible KV layout        READY (topology cached)
               -> 200 but an incompatible layout         INCOMPATIBLE (a clear error, rechecked)
               -> 503 (ranks not all registered yet)     stays PENDING (or keeps READY's data)
               -> unreachable `failure_threshold` times   DEAD (requests waiting on it fail)
    a READY/DEAD entry is re-fetched every `heartbeat_interval` (the heartbeat); one success
    makes a DEAD entry READY again.

The scheduler thread only reads entries (`lookup`); fetching happens on one background thread
so a slow or dead prefill never stalls decoding.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import msgspec

from common.messages.kv_bootstrap import PrefillTopology
from common.transfer.base import KVLayout

logger = logging.getLogger(__name__)


class PeerState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    INCOMPATIBLE = "incompatible"
    DEAD = "dead"


@dataclass
class PeerEntry:
    host: str
    port: int
    state: PeerState = PeerState.PENDING
    topology: PrefillTopology | None = None
    error: str = ""
    failures: int = 0
    next_fetch: float = 0.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class PrefillDirectory:
    def __init__(self, layout: KVLayout, transfer_backend: str, heartbeat_interval: float = 2.0,
                 failure_threshold: int = 2, fetch_timeout: float = 2.0):
        self.layout = layout
        self.transfer_backend = transfer_backend
        self.heartbeat_interval = heartbeat_interval
        self.failure_threshold = failure_threshold
        self.fetch_timeout = fetch_timeout
        self._entries: dict[tuple[str, int], PeerEntry] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefill-directory", daemon=True)
        self._thread.start()

    def lookup(self, host: str, port: int) -> PeerEntry:
        key = (host, port)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = PeerEntry(host, port)
                self._wake.set()
            return entry

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                due = [e for e in self._entries.values() if e.next_fetch <= now]
            for entry in due:
                self._refresh(entry)
            with self._lock:
                pending = [e.next_fetch for e in self._entries.values()]
            delay = max(0.0, min(pending, default=now + 60) - time.monotonic())
            self._wake.wait(timeout=delay)
            self._wake.clear()

    def _refresh(self, entry: PeerEntry) -> None:
        retry_soon = min(0.1, self.heartbeat_interval)
        try:
            topology = self._fetch(entry)
        except _NotReady as exc:
            entry.error = str(exc)
            entry.failures = 0
            entry.next_fetch = time.monotonic() + retry_soon
            return
        except (OSError, ValueError) as exc:
            entry.failures += 1
            entry.error = f"prefill bootstrap server {entry.address} is unreachable: {exc}"
            if entry.failures >= self.failure_threshold and entry.state is not PeerState.DEAD:
                logger.warning("%s; marking it dead", entry.error)
                entry.state = PeerState.DEAD
            entry.next_fetch = time.monotonic() + (
                retry_soon if entry.state is PeerState.PENDING else self.heartbeat_interval)
            return
        entry.failures = 0
        entry.next_fetch = time.monotonic() + self.heartbeat_interval
        problem = self._incompatibility(topology)
        if problem:
            if entry.state is not PeerState.INCOMPATIBLE:
                logger.error("prefill at %s: %s", entry.address, problem)
            entry.error, entry.state = problem, PeerState.INCOMPATIBLE
            return
        if entry.state is not PeerState.READY:
            logger.info("prefill at %s: %d DP slot(s), ranks %s", entry.address,
                        topology.num_dp_slots, sorted(topology.ranks))
        entry.topology, entry.error, entry.state = topology, "", PeerState.READY

    def _fetch(self, entry: PeerEntry) -> PrefillTopology:
        url = f"http://{entry.address}/route"
        try:
            with urllib.request.urlopen(url, timeout=self.fetch_timeout) as resp:
                return msgspec.json.decode(resp.read(), type=PrefillTopology)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
            if exc.code == 503:
                raise _NotReady(f"prefill at {entry.address} is not ready: {message}") from None
            raise ValueError(f"HTTP {exc.code}: {message}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"bad topology: {exc}") from None

    def _incompatibility(self, topology: PrefillTopology) -> str:
        if topology.transfer_backend != self.transfer_backend:
            return (f"transfer backend mismatch: prefill uses {topology.transfer_backend}, "
                    f"decode {self.transfer_backend}")
        for reg in topology.ranks.values():
            theirs = KVLayout(reg.num_layers, reg.page_size, reg.num_kv_heads, reg.head_dim,
                              reg.dtype)
            try:
                self.layout.check_compatible(theirs)
            except ValueError as exc:
                return f"{exc} (prefill rank {reg.dp_rank})"
        return ""


class _NotReady(Exception):
    pass
