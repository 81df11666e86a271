"""`torch` backend: KV pages over a two-rank `torch.distributed` group per prefill/decode pair.

NCCL moves the pages device to device between GPUs; gloo does the same job between CPU pools,
so CPU tests run the very code path the GPUs use. The group is built without a default process
group: the decode side hosts a `TCPStore` (it is the side that knows its own address), the
prefill side connects to it, and both create `ProcessGroupGloo`/`ProcessGroupNCCL` on it.

Both sides already know the page runs (decode chose the destination pages and sent them at
bootstrap), so only bytes move: the sender gathers its runs into one contiguous buffer per
transfer (one `index_select` per layer and kind), sends it, then a small trailer tensor (first
token, logprob); the receiver receives into a buffer and copies each run into place. Each
transfer uses its own tag, so several can be in flight on one pair.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import KVPoll, PageRun, TransferState, TransferTrailer

SENDER, RECEIVER = 0, 1


def _token_index(pool: PagedKVPool, runs: Sequence[PageRun], dst: bool) -> torch.Tensor:
    ps = pool.page_size
    starts = [(r.dst if dst else r.src) * ps for r in runs]
    parts = [torch.arange(start, start + r.length * ps) for start, r in zip(starts, runs)]
    return torch.cat(parts).to(pool.k.device) if parts else torch.empty(0, dtype=torch.long)


class TorchPairChannel:
    """One side of a prefill (rank 0) / decode (rank 1) pair."""

    def __init__(self, host: str, port: int, rank: int, device: torch.device,
                 timeout: float = 30.0):
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.store = dist.TCPStore(host, port, 2, is_master=(rank == RECEIVER),
                                   timeout=datetime.timedelta(seconds=timeout))
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(self.store, rank, 2)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, 2)

    def send(self, pool: PagedKVPool, runs: Sequence[PageRun], trailer: TransferTrailer,
             tag: int) -> TransferState:
        state = TransferState()
        state.advance(KVPoll.Transferring)
        threading.Thread(target=self._send, args=(pool, list(runs), trailer, tag, state),
                         daemon=True).start()
        return state

    def receive(self, pool: PagedKVPool, runs: Sequence[PageRun], tag: int,
                on_trailer) -> TransferState:
        state = TransferState()
        state.advance(KVPoll.WaitingForInput)
        threading.Thread(target=self._receive, args=(pool, list(runs), tag, state, on_trailer),
                         daemon=True).start()
        return state

    def _send(self, pool, runs, trailer, tag, state) -> None:
        try:
            index = _token_index(pool, runs, dst=False)
            buf = torch.stack([
                torch.stack([pool.k[layer].index_select(0, index),
                             pool.v[layer].index_select(0, index)])
                for layer in range(pool.k.shape[0])
            ])
            self.group.send([buf], self.peer, tag).wait()
            meta = torch.tensor([float(trailer.first_token),
                                 float("nan") if trailer.logprob is None else trailer.logprob],
                                dtype=torch.float64, device=buf.device)
            self.group.send([meta], self.peer, tag).wait()
            state.advance(KVPoll.Success)
        except RuntimeError as exc:
            state.fail(f"torch.distributed send failed: {exc}")

    def _receive(self, pool, runs, tag, state, on_trailer) -> None:
        try:
            index = _token_index(pool, runs, dst=True)
            layers = pool.k.shape[0]
            buf = torch.empty((layers, 2, len(index), *pool.k.shape[2:]), dtype=pool.k.dtype,
                              device=pool.k.device)
            meta = torch.empty(2, dtype=torch.float64, device=pool.k.device)
            work = self.group.recv([buf], self.peer, tag)
            state.advance(KVPoll.Transferring)
            work.wait()
            self.group.recv([meta], self.peer, tag).wait()
            for layer in range(layers):
                pool.k[layer].index_copy_(0, index, buf[layer, 0])
                pool.v[layer].index_copy_(0, index, buf[layer, 1])
            logprob = meta[1].item()
            on_trailer(TransferTrailer(first_token=int(meta[0].item()),
                                       logprob=None if logprob != logprob else logprob))
            state.advance(KVPoll.Success)
        except RuntimeError as exc:
            state.fail(f"torch.distributed receive failed: {exc}")
