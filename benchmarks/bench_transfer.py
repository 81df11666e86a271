"""KV transfer throughput of each backend next to a raw loopback socket stream.

    python benchmarks/bench_transfer.py [--sizes-mib 1,16,256] [--repeats 3]
                                        [--backends tcp,torch,fake] [--quick]

For each size, a source and a destination KV pool (SmolLM2-135M's layout: 30 layers, 3 KV
heads, head_dim 64, float32, 16-token pages) are filled and the pages holding that many bytes
are sent through each backend's sender and receiver (tcp; torch, i.e. gloo on CPU; fake, which
moves no KV byte and so measures the handshake alone), with the destination pages scattered
(every other page) so the runs are real. The ceiling is a raw `sendall` / `recv_into` stream of
the same number of bytes over one established loopback connection in the same run. GB/s =
1e9 B/s; best of --repeats after a warm-up transfer that builds each link.
"""

from __future__ import annotations

import argparse
import gc
import platform
import socket
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import cpu_model  # noqa: E402
from common.engine.kv_pool import PagedKVPool  # noqa: E402
from common.transfer.base import KVPoll  # noqa: E402
from common.transfer.base import TransferTrailer  # noqa: E402
from common.transfer.registry import make_receiver, make_sender  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 16
BYTES_PER_PAGE = LAYERS * 2 * HEADS * DIM * 4 * PAGE


def raw_socket_seconds(nbytes: int, repeats: int) -> float:
    """Best time of a raw `sendall` -> `recv_into` stream of nbytes plus a 1-byte ack, on one
    established loopback connection (the same steady state as the backends' links)."""
    src = bytearray(nbytes)
    dst = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            for _ in range(repeats):
                view = memoryview(dst)
                while view:
                    got = conn.recv_into(view)
                    if not got:
                        return
                    view = view[got:]
                conn.sendall(b"\1")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    best = float("inf")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats):
            start = time.perf_counter()
            sock.sendall(memoryview(src))
            sock.recv(1)
            best = min(best, time.perf_counter() - start)
    thread.join(10)
    server.close()
    return best


def pool(pages: int) -> PagedKVPool:
    return PagedKVPool(pages, PAGE, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))


def wait(state) -> None:
    while state.state not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.0002)
    if state.state is not KVPoll.Success:
        raise RuntimeError(state.reason)


def backend_seconds(backend: str, pages: int, repeats: int, scattered: bool = True) -> float:
    """Best time of one transfer of `pages` scattered pages through a backend's sender and
    receiver, after a warm-up transfer that builds the link (connection or process group)."""
    src, dst = pool(pages), pool(2 * pages)
    stride = 2 if scattered else 1
    src.k.normal_()
    src.v.normal_()
    receiver = make_receiver(backend, dst, "127.0.0.1", 120.0)
    sender = make_sender(backend, src, 120.0)
    endpoint = receiver.endpoint_for("bench-prefill")
    src_pages = list(range(pages))
    dst_pages = list(range(0, stride * pages, stride))  # scattered: one run per page
    try:
        receiver.expect(0, dst_pages[:1])
        wait(sender.send(endpoint, 0, src_pages[:1], dst_pages[:1],
                         TransferTrailer(first_token=0)))
        best = float("inf")
        for room in range(1, repeats + 1):
            receiver.expect(room, dst_pages)
            start = time.perf_counter()
            state = sender.send(endpoint, room, src_pages, dst_pages,
                                TransferTrailer(first_token=0))
            wait(state)
            while receiver.poll(room) is not KVPoll.Success:  # decode's side is done too
                time.sleep(0.0002)
            best = min(best, time.perf_counter() - start)
            receiver.forget(room)
        if backend != "fake":
            last = PAGE * stride * (pages - 1)
            assert torch.equal(dst.k[:, last:last + PAGE], src.k[:, PAGE * (pages - 1):])
        return best
    finally:
        sender.close()
        receiver.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,16,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="tcp,torch,fake")
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB, 2 repeats")
    args = parser.parse_args(argv)
    sizes = [1, 16] if args.quick else [int(s) for s in args.sizes_mib.split(",")]
    repeats = 2 if args.quick else args.repeats
    backends = args.backends.split(",")
    print(f"# KV transfer backends vs a raw loopback socket ({time.strftime('%Y-%m-%d')}, "
          f"{cpu_model()}, python {platform.python_version()}, "
          f"torch {torch.__version__})")
    print(f"layout: {LAYERS} layers x K/V x {HEADS} heads x {DIM} dims fp32, {PAGE}-token pages "
          f"({BYTES_PER_PAGE / 2**20:.2f} MiB per page); destination pages scattered; best of "
          f"{repeats} after a warm-up transfer\n")
    print("| KV size | pages | raw socket GB/s | " + " | ".join(
        f"{b} GB/s ({b} / raw)" for b in backends) + " |")
    print("|---:|---:|---:|" + "---:|" * len(backends))
    rows = []
    gc.collect()
    gc.freeze()  # as the scheduler process does once it is loaded
    for mib in sizes:
        pages = max(1, (mib << 20) // BYTES_PER_PAGE)
        nbytes = pages * BYTES_PER_PAGE
        row = {"mib": mib, "pages": pages,
               "raw_gbps": nbytes / raw_socket_seconds(nbytes, repeats) / 1e9}
        cells = []
        for backend in backends:
            gbps = nbytes / backend_seconds(backend, pages, repeats) / 1e9
            row[f"{backend}_gbps"] = gbps
            row[f"{backend}_ratio"] = gbps / row["raw_gbps"]
            cells.append(f"{gbps:.2f} ({gbps / row['raw_gbps']:.2f}x)")
        rows.append(row)
        print(f"| {nbytes / 2**20:.1f} MiB | {pages} | {row['raw_gbps']:.2f} | "
              + " | ".join(cells) + " |", flush=True)
    if "tcp" in backends:
        # A fresh pool hands out consecutive pages, so real requests are mostly a few long
        # runs: the same transfers with contiguous destination pages.
        print("\n| KV size | tcp, contiguous destination GB/s | tcp / raw |")
        print("|---:|---:|---:|")
        for row in rows:
            nbytes = row["pages"] * BYTES_PER_PAGE
            gbps = nbytes / backend_seconds("tcp", row["pages"], repeats, scattered=False) / 1e9
            row["tcp_contiguous_gbps"] = gbps
            print(f"| {nbytes / 2**20:.1f} MiB | {gbps:.2f} | {gbps / row['raw_gbps']:.2f}x |",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
