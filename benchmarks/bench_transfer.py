"""KV transfer throughput of the `tcp` backend next to a raw loopback socket stream.

    python benchmarks/bench_transfer.py [--sizes-mib 1,16,256] [--repeats 3] [--quick]

For each size, a source and a destination KV pool (SmolLM2-135M's layout: 30 layers, 3 KV
heads, head_dim 64, float32, 16-token pages) are filled and the pages holding that many bytes
are sent with `TcpKVSender` into `TcpKVReceiver`, with the destination pages scattered (every
other page) so the runs are real. The ceiling is a raw `sendall` / `recv_into` stream of the
same number of bytes over loopback in the same run. GB/s = 1e9 B/s; best of --repeats.
"""

from __future__ import annotations

import argparse
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
from common.transfer.tcp import TcpKVReceiver, TcpKVSender, TransferTrailer  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 16
BYTES_PER_PAGE = LAYERS * 2 * HEADS * DIM * 4 * PAGE


def raw_socket_seconds(nbytes: int) -> float:
    src = bytearray(nbytes)
    dst = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            view = memoryview(dst)
            while view:
                got = conn.recv_into(view)
                if not got:
                    break
                view = view[got:]
            conn.sendall(b"\1")
        done.set()

    threading.Thread(target=receive, daemon=True).start()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.sendall(memoryview(src))
        sock.recv(1)
    elapsed = time.perf_counter() - start
    done.wait(10)
    server.close()
    return elapsed


def tcp_backend_seconds(pages: int) -> float:
    def pool(n):
        return PagedKVPool(n, PAGE, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))

    src, dst = pool(pages), pool(2 * pages)
    src.k.normal_()
    src.v.normal_()
    receiver = TcpKVReceiver(dst)
    try:
        src_pages = list(range(pages))
        dst_pages = list(range(0, 2 * pages, 2))  # scattered: one run per page
        receiver.expect(1, dst_pages)
        start = time.perf_counter()
        state = TcpKVSender(src).send(receiver.endpoint, 1, src_pages, dst_pages,
                                      TransferTrailer(first_token=0))
        while state.state not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        elapsed = time.perf_counter() - start
        if state.state is not KVPoll.Success:
            raise RuntimeError(state.reason)
        assert torch.equal(dst.k[:, PAGE * 2 * (pages - 1):PAGE * (2 * pages - 1)],
                           src.k[:, PAGE * (pages - 1):PAGE * pages])
        return elapsed
    finally:
        receiver.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,16,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB, 2 repeats")
    args = parser.parse_args(argv)
    sizes = [1, 16] if args.quick else [int(s) for s in args.sizes_mib.split(",")]
    repeats = 2 if args.quick else args.repeats
    print(f"# KV transfer, tcp backend vs raw loopback socket ({time.strftime('%Y-%m-%d')}, "
          f"{cpu_model()}, python {platform.python_version()}, "
          f"torch {torch.__version__})")
    print(f"layout: {LAYERS} layers x K/V x {HEADS} heads x {DIM} dims fp32, {PAGE}-token pages "
          f"({BYTES_PER_PAGE / 2**20:.2f} MiB per page); destination pages scattered\n")
    print("| KV size | pages | raw socket GB/s | tcp backend GB/s | tcp / raw |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for mib in sizes:
        pages = max(1, (mib << 20) // BYTES_PER_PAGE)
        nbytes = pages * BYTES_PER_PAGE
        raw = min(raw_socket_seconds(nbytes) for _ in range(repeats))
        tcp = min(tcp_backend_seconds(pages) for _ in range(repeats))
        row = {"mib": mib, "pages": pages, "raw_gbps": nbytes / raw / 1e9,
               "tcp_gbps": nbytes / tcp / 1e9}
        row["ratio"] = row["tcp_gbps"] / row["raw_gbps"]
        rows.append(row)
        print(f"| {nbytes / 2**20:.1f} MiB | {pages} | {row['raw_gbps']:.2f} | "
              f"{row['tcp_gbps']:.2f} | {row['ratio']:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
