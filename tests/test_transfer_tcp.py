"""The tcp KV transfer backend between two real pools in one process (loopback sockets)."""

from __future__ import annotations

import time

import pytest
import torch

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import KVPoll
from common.transfer.tcp import TcpKVReceiver, TcpKVSender, TransferTrailer


def pool(page_size=4, pages=32, layers=3, heads=2, dim=8, dtype=torch.float32):
    return PagedKVPool(pages, page_size, layers, heads, dim, dtype, torch.device("cpu"))


def wait(state_fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while state_fn() not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline, "transfer never finished"
        time.sleep(0.005)
    return state_fn()


def fill(p: PagedKVPool, seed=0):
    g = torch.Generator().manual_seed(seed)
    p.k.copy_(torch.randn(p.k.shape, generator=g).to(p.k.dtype))
    p.v.copy_(torch.randn(p.v.shape, generator=g).to(p.v.dtype))


def page_data(p: PagedKVPool, page: int):
    ps = p.page_size
    return p.k[:, page * ps:(page + 1) * ps].clone(), p.v[:, page * ps:(page + 1) * ps].clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_arrive_intact_with_the_trailer(dtype):
    src, dst = pool(dtype=dtype), pool(dtype=dtype)
    fill(src)
    receiver = TcpKVReceiver(dst)
    try:
        src_pages, dst_pages = [3, 4, 5, 9, 1], [10, 11, 20, 21, 2]
        receiver.expect(42, dst_pages)
        assert receiver.poll(42) is KVPoll.WaitingForInput
        untouched = page_data(dst, 0)
        sent = TcpKVSender(src).send(receiver.endpoint, 42, src_pages, dst_pages,
                                     TransferTrailer(first_token=7, logprob=-0.5))
        assert wait(lambda: receiver.poll(42)) is KVPoll.Success
        assert wait(lambda: sent.state) is KVPoll.Success
        for s, d in zip(src_pages, dst_pages):
            for a, b in zip(page_data(src, s), page_data(dst, d)):
                assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(untouched, page_data(dst, 0)))
        assert receiver.trailer(42) == TransferTrailer(first_token=7, logprob=-0.5)
        assert receiver.pages_quiescent(42)
    finally:
        receiver.close()


def test_unexpected_room_and_foreign_pages_are_refused():
    src, dst = pool(), pool()
    receiver = TcpKVReceiver(dst)
    try:
        sent = TcpKVSender(src).send(receiver.endpoint, 1, [0], [0], TransferTrailer(first_token=1))
        assert wait(lambda: sent.state) is KVPoll.Failed and "refused" in sent.reason
        receiver.expect(2, [5])
        sent = TcpKVSender(src).send(receiver.endpoint, 2, [0], [6], TransferTrailer(first_token=1))
        assert wait(lambda: sent.state) is KVPoll.Failed
        assert receiver.poll(2) is KVPoll.Failed
        receiver.expect(3, [1])
        with pytest.raises(ValueError, match="already expected"):
            receiver.expect(3, [1])
    finally:
        receiver.close()


def test_layout_mismatch_fails_both_sides_clearly():
    src, dst = pool(page_size=4), pool(page_size=8, pages=16)
    receiver = TcpKVReceiver(dst)
    try:
        receiver.expect(5, [1])
        sent = TcpKVSender(src).send(receiver.endpoint, 5, [1, 2], [1, 2],
                                     TransferTrailer(first_token=1))
        assert wait(lambda: sent.state) is KVPoll.Failed
        assert wait(lambda: receiver.poll(5)) is KVPoll.Failed
    finally:
        receiver.close()


def test_dead_receiver_fails_the_sender():
    src, dst = pool(), pool()
    receiver = TcpKVReceiver(dst)
    endpoint = receiver.endpoint
    receiver.close()
    sent = TcpKVSender(src, timeout=2).send(endpoint, 1, [0], [0], TransferTrailer(first_token=1))
    assert wait(lambda: sent.state) is KVPoll.Failed and "failed" in sent.reason


def test_sender_dying_mid_transfer_fails_the_room_and_frees_its_pages():
    """A prefill that dies after the header (half the bytes sent) leaves decode Failed, with
    pages quiescent: nothing can write into them any more."""
    import socket as socket_mod

    from common.transfer.base import contiguous_runs
    from common.transfer.tcp import TransferHeader, _send_msg, pool_layout

    src, dst = pool(), pool()
    receiver = TcpKVReceiver(dst)
    try:
        receiver.expect(9, [4, 5])
        layout = pool_layout(src)
        host, _, port = receiver.endpoint.rpartition(":")
        with socket_mod.create_connection((host, int(port))) as sock:
            _send_msg(sock, TransferHeader(room=9, runs=contiguous_runs([0, 1], [4, 5]),
                                           num_layers=layout.num_layers,
                                           page_size=layout.page_size,
                                           num_kv_heads=layout.num_kv_heads,
                                           head_dim=layout.head_dim, dtype=layout.dtype))
            sock.sendall(b"\0" * 100)
        assert wait(lambda: receiver.poll(9)) is KVPoll.Failed
        assert receiver.pages_quiescent(9)
    finally:
        receiver.close()


def test_cancel_cuts_a_transfer_in_progress():
    import socket as socket_mod

    from common.transfer.base import contiguous_runs
    from common.transfer.tcp import TransferHeader, _send_msg, pool_layout

    src, dst = pool(), pool()
    receiver = TcpKVReceiver(dst)
    try:
        receiver.expect(3, [4])
        layout = pool_layout(src)
        host, _, port = receiver.endpoint.rpartition(":")
        with socket_mod.create_connection((host, int(port))) as sock:
            _send_msg(sock, TransferHeader(room=3, runs=contiguous_runs([0], [4]),
                                           num_layers=layout.num_layers,
                                           page_size=layout.page_size,
                                           num_kv_heads=layout.num_kv_heads,
                                           head_dim=layout.head_dim, dtype=layout.dtype))
            sock.sendall(b"\0" * 100)  # part of the page: the receiver is mid-transfer
            deadline = time.monotonic() + 5
            while receiver.poll(3) is not KVPoll.Transferring:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert not receiver.pages_quiescent(3)
            receiver.cancel(3, "client disconnected")
            deadline = time.monotonic() + 5
            while not receiver.pages_quiescent(3):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert receiver.poll(3) is KVPoll.Failed
    finally:
        receiver.close()


def test_fake_backend_delivers_the_first_token_without_bytes():
    from common.transfer.tcp import FakeKVSender

    src, dst = pool(), pool()
    fill(src)
    receiver = TcpKVReceiver(dst)
    try:
        receiver.expect(4, [2, 3])
        sent = FakeKVSender(src).send(receiver.endpoint, 4, [0, 1], [2, 3],
                                      TransferTrailer(first_token=5))
        assert wait(lambda: receiver.poll(4)) is KVPoll.Success
        assert wait(lambda: sent.state) is KVPoll.Success
        assert receiver.trailer(4).first_token == 5
        assert not dst.k.any()  # no KV byte moved
    finally:
        receiver.close()


def test_a_refused_transfer_leaves_the_connection_usable():
    """A refused room's bytes are drained without touching any page, and the next transfer on
    the same persistent connection still lands."""
    src, dst = pool(), pool()
    fill(src)
    receiver = TcpKVReceiver(dst)
    sender = TcpKVSender(src)
    try:
        refused = sender.send(receiver.endpoint, 1, [0, 1], [2, 3],
                              TransferTrailer(first_token=1))
        assert wait(lambda: refused.state) is KVPoll.Failed and "refused" in refused.reason
        assert not dst.k.any()
        receiver.expect(2, [5])
        sent = sender.send(receiver.endpoint, 2, [4], [5], TransferTrailer(first_token=2))
        assert wait(lambda: sent.state) is KVPoll.Success
        assert torch.equal(page_data(src, 4)[0], page_data(dst, 5)[0])
        assert len(sender._links) == 1  # one connection carried both
    finally:
        sender.close()
        receiver.close()
