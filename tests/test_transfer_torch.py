"""The `torch` KV transfer backend on CPU (gloo): the same code path NCCL takes on GPUs."""

from __future__ import annotations

import threading
import time

import torch

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import KVPoll, contiguous_runs
from common.transfer.base import TransferTrailer
from common.transfer.torch_dist import RECEIVER, SENDER, TorchPairChannel
from server_utils import free_port


def pool(pages=16):
    p = PagedKVPool(pages, 4, 2, 2, 8, torch.float32, torch.device("cpu"))
    return p


def wait(fn, timeout=20):
    deadline = time.monotonic() + timeout
    while fn() not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return fn()


def test_gloo_pair_moves_pages_and_trailer():
    port = free_port()
    channels = {}

    def make(rank):
        channels[rank] = TorchPairChannel("127.0.0.1", port, rank, torch.device("cpu"))

    threads = [threading.Thread(target=make, args=(r,)) for r in (RECEIVER, SENDER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    src, dst = pool(), pool()
    src.k.normal_()
    src.v.normal_()
    runs = contiguous_runs([1, 2, 7], [9, 10, 3])
    got = []
    recv_state = channels[RECEIVER].receive(dst, runs, tag=5, on_trailer=got.append)
    send_state = channels[SENDER].send(src, runs, TransferTrailer(first_token=11, logprob=-1.5),
                                       tag=5)
    assert wait(lambda: send_state.state) is KVPoll.Success
    assert wait(lambda: recv_state.state) is KVPoll.Success
    assert got == [TransferTrailer(first_token=11, logprob=-1.5)]
    for s, d in ((1, 9), (2, 10), (7, 3)):
        assert torch.equal(src.k[:, s * 4:(s + 1) * 4], dst.k[:, d * 4:(d + 1) * 4])
        assert torch.equal(src.v[:, s * 4:(s + 1) * 4], dst.v[:, d * 4:(d + 1) * 4])
    assert not dst.k[:, 0:4].any()  # pages outside the runs are untouched
