"""`torch` backend: KV pages over a two-rank `torch.distributed` group per prefill/decode pair.

NCCL moves the pages device to device between GPUs; gloo does the same job between CPU pools,
so CPU tests run the very code path the GPUs use. Groups are built without a default process
group, on demand: the decode side hosts a `TCPStore` per prefill peer (`endpoint_for(peer)`
returns its address, which decode sends to prefill with each request's page indices), the
prefill side connects to it on its first transfer to that address, and both build
`ProcessGroupGloo`/`ProcessGroupNCCL` on it.

Per pair, transfers are sequential and self-describing, so decode never posts a receive it
might have to abandon:

    header   int64 [room, num_tokens, trailer_bytes]
    payload  [layers, 2 (K, V), num_tokens, kv_heads, head_dim], gathered from the source pages
    trailer  uint8, a msgpack `TransferTrailer` (first token, logprob, top logprobs)

Decode's pair thread receives the header (the room is now Transferring), then the payload into
a staging buffer; only if the room is still expected (not cancelled) does it copy the buffer
into the room's pages, under the lock that `cancel` takes, so a late or unwanted transfer is
drained and dropped without touching any page. A pair whose group fails (peer died) fails the
room it was receiving, is dropped, and is rebuilt on demand.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Sequence

import msgspec
import torch
import torch.distributed as dist

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import (
    ExpectedRooms,
    KVPoll,
    PageRun,
    TransferState,
    TransferTrailer,
    contiguous_runs,
)

logger = logging.getLogger(__name__)

SENDER, RECEIVER = 0, 1
TAG = 0


def _source_token_index(pool: PagedKVPool, runs: Sequence[PageRun]) -> torch.Tensor:
    """Token slots of the runs' source pages, in run order (the payload's order)."""
    ps = pool.page_size
    starts = [r.src * ps for r in runs]
    parts = [torch.arange(start, start + r.length * ps) for start, r in zip(starts, runs)]
    if not parts:
        return torch.empty(0, dtype=torch.long, device=pool.k.device)
    return torch.cat(parts).to(pool.k.device)


def _scatter(pool: PagedKVPool, dst_pages: Sequence[int], payload: torch.Tensor) -> None:
    """Copy the payload into the destination pages: one slice copy per contiguous run, layer
    and kind (on CPU several times faster than `index_copy_` over page-sized rows)."""
    ps = pool.page_size
    offset = 0
    for run in contiguous_runs(dst_pages, dst_pages):
        tokens = run.length * ps
        start = run.dst * ps
        pool.k[:, start:start + tokens].copy_(payload[:, 0, offset:offset + tokens])
        pool.v[:, start:start + tokens].copy_(payload[:, 1, offset:offset + tokens])
        offset += tokens


def _group(store: dist.Store, rank: int, device: torch.device,
           timeout: float) -> dist.ProcessGroup:
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout))


class TorchPairChannel:
    """One side of a prefill (rank 0) / decode (rank 1) pair; blocks until both have joined."""

    def __init__(self, host: str, port: int, rank: int, device: torch.device,
                 timeout: float = 30.0, store: dist.Store | None = None):
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.store = store or dist.TCPStore(host, port, 2, is_master=(rank == RECEIVER),
                                            timeout=datetime.timedelta(seconds=timeout))
        self.group = _group(self.store, rank, device, timeout)

    def send_transfer(self, pool: PagedKVPool, room: int, runs: Sequence[PageRun],
                      trailer: TransferTrailer) -> None:
        index = _source_token_index(pool, runs)
        # One gather per layer and kind straight into the payload (no intermediate copies).
        payload = torch.empty((pool.k.shape[0], 2, len(index), *pool.k.shape[2:]),
                              dtype=pool.k.dtype, device=pool.k.device)
        for layer in range(pool.k.shape[0]):
            torch.index_select(pool.k[layer], 0, index, out=payload[layer, 0])
            torch.index_select(pool.v[layer], 0, index, out=payload[layer, 1])
        meta = torch.frombuffer(bytearray(msgspec.msgpack.encode(trailer)), dtype=torch.uint8)
        header = torch.tensor([room, len(index), len(meta)], dtype=torch.int64)
        for tensor in (header, payload, meta):
            self.group.send([tensor.to(self.device)], self.peer, TAG).wait()

    def recv_header(self) -> tuple[int, int, int]:
        """(room, num_tokens, trailer bytes) of the next transfer on this pair."""
        header = torch.empty(3, dtype=torch.int64, device=self.device)
        self.group.recv([header], self.peer, TAG).wait()
        room, num_tokens, trailer_len = header.tolist()
        return room, num_tokens, trailer_len

    def recv_body(self, pool: PagedKVPool, num_tokens: int,
                  trailer_len: int) -> tuple[torch.Tensor, TransferTrailer]:
        payload = torch.empty((pool.k.shape[0], 2, num_tokens, *pool.k.shape[2:]),
                              dtype=pool.k.dtype, device=self.device)
        self.group.recv([payload], self.peer, TAG).wait()
        meta = torch.empty(trailer_len, dtype=torch.uint8, device=self.device)
        self.group.recv([meta], self.peer, TAG).wait()
        trailer = msgspec.msgpack.decode(meta.cpu().numpy().tobytes(), type=TransferTrailer)
        return payload, trailer


class TorchKVReceiver(ExpectedRooms):
    def __init__(self, pool: PagedKVPool, host: str = "127.0.0.1", timeout: float = 300.0):
        super().__init__()
        self.pool = pool
        self.host = host
        self.timeout = timeout
        self._pairs: dict[str, str] = {}  # prefill peer -> the store address it connects to
        self._closed = False

    def endpoint_for(self, peer: str) -> str:
        with self._lock:
            endpoint = self._pairs.get(peer)
            if endpoint is None:
                store = dist.TCPStore(self.host, 0, 2, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=self.timeout))
                endpoint = f"{self.host}:{store.port}"
                self._pairs[peer] = endpoint
                threading.Thread(target=self._serve_pair, args=(peer, store), daemon=True,
                                 name=f"kv-pair-{peer}").start()
            return endpoint

    def close(self) -> None:
        self._closed = True

    def _serve_pair(self, peer: str, store: dist.Store) -> None:
        room = None
        try:
            channel = TorchPairChannel("", 0, RECEIVER, self.pool.k.device, self.timeout,
                                       store=store)
            while not self._closed:
                room, num_tokens, trailer_len = channel.recv_header()
                self._start(room, num_tokens)
                payload, trailer = channel.recv_body(self.pool, num_tokens, trailer_len)
                self._deliver(room, payload, trailer)
                room = None
        except RuntimeError as exc:
            logger.warning("KV pair with %s closed: %s", peer, exc)
            if room is not None:
                self._fail_room(room, f"the KV pair with prefill {peer} broke mid-transfer: "
                                      f"{exc}")
        finally:
            with self._lock:
                if self._pairs.get(peer) is not None:
                    del self._pairs[peer]

    def _start(self, room: int, num_tokens: int) -> None:
        """The header arrived: the room's KV is on its way (into a staging buffer)."""
        with self._lock:
            record = self._expected.get(room)
            if record is None or record.state.state is not KVPoll.WaitingForInput:
                return  # cancelled or unknown: the bytes will be dropped
            if num_tokens != len(record.dst_pages) * self.pool.page_size:
                record.state.fail(f"the sender sent {num_tokens} tokens of KV for "
                                  f"{len(record.dst_pages)} pages")
                return
            record.state.advance(KVPoll.Transferring)

    def _fail_room(self, room: int, reason: str) -> None:
        with self._lock:
            record = self._expected.get(room)
            if record is not None:
                record.state.fail(reason)

    def _deliver(self, room: int, payload: torch.Tensor, trailer: TransferTrailer) -> None:
        with self._lock:
            record = self._expected.get(room)
            if record is None or record.state.state is not KVPoll.Transferring:
                return  # cancelled, refused or unknown: dropped, no page is touched
            record.busy = True
        try:
            _scatter(self.pool, record.dst_pages, payload)
        finally:
            with self._lock:
                record.busy = False
                if record.state.state is KVPoll.Transferring:
                    record.trailer = trailer
                    record.state.advance(KVPoll.Success)


class _PairSender:
    """One thread per decode endpoint: builds the pair, then sends queued transfers in order."""

    def __init__(self, owner: TorchKVSender, endpoint: str):
        self.owner = owner
        self.endpoint = endpoint
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=f"kv-send-{endpoint}").start()

    def _run(self) -> None:
        pool = self.owner.pool
        host, _, port = self.endpoint.rpartition(":")
        try:
            channel = TorchPairChannel(host, int(port), SENDER, pool.k.device,
                                       self.owner.timeout)
        except (RuntimeError, ValueError) as exc:
            self._fail_all(f"could not join the KV pair at {self.endpoint}: {exc}")
            return
        while True:
            room, runs, trailer, state = self.jobs.get()
            if state.state is KVPoll.Failed:  # given up before its turn came
                state.pages_released = True
                continue
            try:
                channel.send_transfer(pool, room, runs, trailer)
                state.advance(KVPoll.Success)
            except RuntimeError as exc:
                state.fail(f"sending KV for room {room} to {self.endpoint} failed: {exc}")
                self._fail_all(f"the KV pair at {self.endpoint} failed: {exc}")
                return
            finally:
                state.pages_released = True

    def _fail_all(self, reason: str) -> None:
        self.owner._drop(self.endpoint, self)
        while True:
            try:
                *_, state = self.jobs.get_nowait()
            except queue.Empty:
                return
            state.fail(reason)
            state.pages_released = True


class TorchKVSender:
    def __init__(self, pool: PagedKVPool, timeout: float = 300.0):
        self.pool = pool
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pairs: dict[str, _PairSender] = {}

    def send(self, endpoint: str, room: int, src_pages: Sequence[int],
             dst_pages: Sequence[int], trailer: TransferTrailer) -> TransferState:
        state = TransferState()
        state.advance(KVPoll.Transferring)
        runs = contiguous_runs(src_pages, dst_pages)
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is None:
                pair = self._pairs[endpoint] = _PairSender(self, endpoint)
            pair.jobs.put((room, runs, trailer, state))
        return state

    def close(self) -> None:
        pass

    def _drop(self, endpoint: str, pair: _PairSender) -> None:
        with self._lock:
            if self._pairs.get(endpoint) is pair:
                del self._pairs[endpoint]
