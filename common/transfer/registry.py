"""`--disaggregation-transfer-backend`: the name -> (sender, receiver) table.

    tcp    KV pages over TCP sockets straight between the pools (CPU pools; the CPU default)
    torch  torch.distributed point-to-point per prefill/decode pair: NCCL between GPUs,
           gloo between CPU pools
    fake   the tcp handshake and first token without any KV byte (warm-up, benchmarks)
"""

from __future__ import annotations

from common.engine.kv_pool import PagedKVPool
from common.transfer.base import KVReceiver, KVSender

BACKENDS = ("tcp", "torch", "fake")


def resolve_backend(name: str, pool: PagedKVPool) -> str:
    """auto: tcp for CPU pools, torch (NCCL) for GPU pools."""
    if name == "auto":
        return "tcp" if pool.k.device.type == "cpu" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")
    if name in ("tcp", "fake") and pool.k.device.type != "cpu":
        raise ValueError(f"the {name} backend moves CPU pools; use torch for {pool.k.device}")
    return name


def make_receiver(name: str, pool: PagedKVPool, host: str, timeout: float) -> KVReceiver:
    if name == "torch":
        from common.transfer.torch_dist import TorchKVReceiver

        return TorchKVReceiver(pool, host, timeout)
    from common.transfer.tcp import TcpKVReceiver

    return TcpKVReceiver(pool, host)


def make_sender(name: str, pool: PagedKVPool, timeout: float) -> KVSender:
    if name == "torch":
        from common.transfer.torch_dist import TorchKVSender

        return TorchKVSender(pool, timeout)
    from common.transfer.tcp import FakeKVSender, TcpKVSender

    return (FakeKVSender if name == "fake" else TcpKVSender)(pool, timeout)
