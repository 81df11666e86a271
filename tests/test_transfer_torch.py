"""The `torch` KV transfer backend on CPU (gloo): the same code path NCCL takes on GPUs."""

from __future__ import annotations

import time

import torch

from common.engine.kv_pool import PagedKVPool
from common.messages.sampling import TopLogprobs
from common.transfer.base import KVPoll, TransferTrailer
from common.transfer.torch_dist import TorchKVReceiver, TorchKVSender


def pool(pages=16):
    return PagedKVPool(pages, 4, 2, 2, 8, torch.float32, torch.device("cpu"))


def wait(fn, timeout=20):
    deadline = time.monotonic() + timeout
    while fn() not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return fn()


def test_gloo_pair_moves_pages_and_trailer_then_drops_cancelled_rooms():
    src, dst = pool(), pool()
    src.k.normal_()
    src.v.normal_()
    receiver, sender = TorchKVReceiver(dst, "127.0.0.1", 20), TorchKVSender(src, 20)
    endpoint = receiver.endpoint_for("prefill-0")
    assert receiver.endpoint_for("prefill-0") == endpoint  # one pair per peer
    trailer = TransferTrailer(first_token=11, logprob=-1.5,
                              top_logprobs=TopLogprobs([11, 3], [-1.5, -2.0]))
    receiver.expect(5, [9, 10, 3])
    sent = sender.send(endpoint, 5, [1, 2, 7], [9, 10, 3], trailer)
    assert wait(lambda: receiver.poll(5)) is KVPoll.Success
    assert wait(lambda: sent.state) is KVPoll.Success
    assert receiver.trailer(5) == trailer
    for s, d in ((1, 9), (2, 10), (7, 3)):
        assert torch.equal(src.k[:, s * 4:(s + 1) * 4], dst.k[:, d * 4:(d + 1) * 4])
        assert torch.equal(src.v[:, s * 4:(s + 1) * 4], dst.v[:, d * 4:(d + 1) * 4])
    assert not dst.k[:, 0:4].any()  # pages outside the runs are untouched

    # a cancelled room: the bytes are drained and dropped; the next transfer still works
    receiver.expect(6, [4])
    receiver.cancel(6, "client disconnected")
    assert receiver.pages_quiescent(6)
    sender.send(endpoint, 6, [1], [4], TransferTrailer(first_token=1))
    receiver.expect(7, [5])
    sender.send(endpoint, 7, [2], [5], TransferTrailer(first_token=2))
    assert wait(lambda: receiver.poll(7)) is KVPoll.Success
    assert receiver.poll(6) is KVPoll.Failed
    assert not dst.k[:, 16:20].any()
    assert torch.equal(src.k[:, 8:12], dst.k[:, 20:24])


def test_unreachable_pair_fails_the_transfer():
    sender = TorchKVSender(pool(), timeout=2)
    from server_utils import free_port

    sent = sender.send(f"127.0.0.1:{free_port()}", 1, [0], [0], TransferTrailer(first_token=1))
    assert wait(lambda: sent.state, timeout=30) is KVPoll.Failed
    assert "could not join" in sent.reason
