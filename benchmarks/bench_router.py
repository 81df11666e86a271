"""Router overhead: requests/s at 64 connections and added latency at 1 connection.

Every target gets the same load from the same client, against mock workers that answer at
once (raw asyncio, HTTP/1.1 keep-alive, TCP_NODELAY, a few microseconds per request, so the
mock is not what is measured):

    direct        client -> mock                       (the baseline)
    pdserve       client -> `pdserve router --pd-disaggregation` -> prefill mock + decode mock
    sglang        client -> `sglang-router launch --pd-disaggregation` -> the same mocks
                  (only with `--sglang-router [BIN]`)

Modes: non-streaming `/generate` (a ~300-byte JSON answer) and streaming (`"stream": true`:
four SSE events, each written by the mock as its own small packet, then `data: [DONE]`; on a
keep-alive connection a missing TCP_NODELAY shows up as a ~40 ms stall per request). Latency at
1 connection is the time from sending the request to the last byte of the answer; "added" is
that minus the direct p50 (same client, same keep-alive connection reuse). Latency requests come
in slices with the targets interleaved, like the throughput runs, so a burst of load from other
jobs hits every target alike. The client is a raw asyncio HTTP/1.1 client in this process, the
mocks run in one other process, each router in its own.

    python benchmarks/bench_router.py                                   # pdserve vs direct
    python benchmarks/bench_router.py --sglang-router     # + the sglang-router of this venv
    python benchmarks/bench_router.py --sglang-router /path/to/venv/bin/sglang-router
    python benchmarks/bench_router.py --sglang-router --latency-only    # the 1-connection part
    python benchmarks/bench_router.py --quick                           # ~15 s smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_model  # noqa: E402

ANSWER = (b'{"text":"The capital of France is Paris.","output_ids":[504,3575,282,4649,314,'
          b'7042,30],"meta_info":{"id":"r","finish_reason":{"type":"stop","matched":2},'
          b'"prompt_tokens":9,"completion_tokens":7,"cached_tokens":0,"e2e_latency":0.01}}')
EVENTS = [b'data: {"text":"%s","output_ids":[%d],"meta_info":{"id":"r","finish_reason":null}}'
          b'\n\n' % (b"tok" * (i + 1), i) for i in range(4)] + [b"data: [DONE]\n\n"]
REQUEST_BODY = (b'{"text":"What is the capital of France?","sampling_params":'
                b'{"max_new_tokens":8,"temperature":0}%s}')


# ---- mock worker -----------------------------------------------------------------------------
class MockProtocol(asyncio.Protocol):
    """Minimal HTTP/1.1 server: GET -> {"status":"ok"}; POST -> ANSWER, or SSE when the body
    asks for a stream (each event its own chunk and its own write)."""

    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0
                                  else None].strip())
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4:total])
            del self.buffer[:total]
            self.respond(head, body)

    def respond(self, head: bytes, body: bytes) -> None:
        write = self.transport.write
        if head.startswith(b"get"):
            payload = b'{"status":"ok"}'
            write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                  b"\r\n\r\n%s" % (len(payload), payload))
        elif b'"stream":true' in body or b'"stream": true' in body:
            write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
            for event in EVENTS:
                write(b"%x\r\n%s\r\n" % (len(event), event))
            write(b"0\r\n\r\n")
        else:
            write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                  b"\r\n\r\n%s" % (len(ANSWER), ANSWER))


async def serve_mocks(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    for port in ports:
        await loop.create_server(MockProtocol, "127.0.0.1", port, backlog=1024)
    await asyncio.Event().wait()


# ---- client ----------------------------------------------------------------------------------
class Connection:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> int:
        """Sends one request, reads the whole answer; returns the status."""
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    return status
        at = lower.find(b"content-length:")
        length = int(lower[at + 15:lower.find(b"\r\n", at)].strip())
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def raw_request(stream: bool) -> bytes:
    body = REQUEST_BODY % (b',"stream":true' if stream else b"")
    return (b"POST /generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def throughput(port: int, stream: bool, connections: int, seconds: float) -> float:
    raw = raw_request(stream)
    conns = [await Connection.open(port) for _ in range(connections)]
    done = errors = 0
    measuring = False

    async def loop(conn: Connection, deadline: float) -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            status = await conn.request(raw)
            if measuring:
                done += 1
                errors += status != 200
    warm = time.perf_counter() + min(0.5, seconds / 4)
    await asyncio.gather(*(loop(c, warm) for c in conns))
    measuring = True
    started = time.perf_counter()
    await asyncio.gather(*(loop(c, started + seconds) for c in conns))
    elapsed = time.perf_counter() - started
    for c in conns:
        c.close()
    if errors:
        raise RuntimeError(f"{errors} of {done} requests failed")
    return done / elapsed


async def latencies(port: int, stream: bool, count: int) -> list[float]:
    raw = raw_request(stream)
    conn = await Connection.open(port)
    for _ in range(min(200, count)):
        await conn.request(raw)
    out = []
    for _ in range(count):
        started = time.perf_counter()
        status = await conn.request(raw)
        out.append(time.perf_counter() - started)
        if status != 200:
            raise RuntimeError(f"status {status}")
    conn.close()
    return out


# ---- processes -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@dataclass
class Target:
    name: str
    port: int
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_pdserve(prefill: int, decode: int, logdir: Path) -> Target:
    port = free_port()
    proc = spawn([sys.executable, "-m", "common.cli", "router", "--pd-disaggregation",
                  "--port", str(port), "--prefill", f"http://127.0.0.1:{prefill}", "none",
                  "--decode", f"http://127.0.0.1:{decode}", "--policy", "round_robin",
                  "--log-level", "warning"], logdir / "pdserve-router.log")
    wait_ready(f"http://127.0.0.1:{port}/readiness")
    return Target("pdserve router", port, proc)


def sglang_command(given: str) -> list[str]:
    """How to start sglang-router: the executable given, or ("auto") the `sglang-router`
    console script of this Python's environment, else its module form."""
    if given != "auto":
        return [given, "launch"]
    script = Path(sys.executable).parent / "sglang-router"
    if script.exists():
        return [str(script), "launch"]
    return [sys.executable, "-m", "sglang_router.launch_router"]


def start_sglang(command: list[str], prefill: int, decode: int, logdir: Path) -> Target:
    port = free_port()
    proc = spawn([*command, "--pd-disaggregation", "--port", str(port),
                  "--host", "127.0.0.1", "--prefill", f"http://127.0.0.1:{prefill}", "none",
                  "--decode", f"http://127.0.0.1:{decode}", "--policy", "round_robin",
                  "--prometheus-port", str(free_port()), "--log-level", "warn"],
                 logdir / "sglang-router.log")
    wait_ready(f"http://127.0.0.1:{port}/health")
    return Target("sglang-router", port, proc)


def sglang_version(command: list[str]) -> str:
    """The installed version, asked of the Python that runs it."""
    python = command[0] if command[1:2] == ["-m"] else Path(command[0]).parent / "python"
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('sglang-router'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        return "unknown"
    return out or "unknown"


# ---- report ----------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(targets: list[Target], args: argparse.Namespace) -> dict:
    """Throughput runs interleave the targets (a burst of load from other jobs on a shared
    machine then hits all of them alike); each keeps its best run."""
    modes = (False, True)
    rps = {(t.name, m): [] for t in targets for m in modes}
    for _ in range(0 if args.latency_only else args.repeats):
        for target in targets:
            for stream in modes:
                rps[(target.name, stream)].append(
                    await throughput(target.port, stream, args.connections, args.seconds))
    # Latency too: the requests of each target come in `rounds` slices, targets interleaved.
    lat = {(t.name, m): [] for t in targets for m in modes}
    rounds = max(1, min(args.latency_rounds, args.latency_requests // 100))
    for _ in range(rounds):
        for target in targets:
            for stream in modes:
                lat[(target.name, stream)] += await latencies(
                    target.port, stream, args.latency_requests // rounds)
    results = {}
    for target in targets:
        row = results[target.name] = {}
        for stream in modes:
            values = lat[(target.name, stream)]
            row["stream" if stream else "unary"] = {
                "rps": max(rps[(target.name, stream)], default=0.0), "p50": statistics.median(values),
                "p99": pct(values, 0.99)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs; best kept")
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--latency-rounds", type=int, default=4,
                        help="latency requests come in this many slices, targets interleaved")
    parser.add_argument("--latency-only", action="store_true", help="skip the throughput runs")
    parser.add_argument("--sglang-router", nargs="?", const="auto", default=None,
                        metavar="BIN",
                        help="compare with sglang-router: the path of its `sglang-router` "
                             "executable, or no value for the one installed with this Python "
                             "(console script, else `python -m sglang_router.launch_router`)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mock", nargs="+", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mock:
        asyncio.run(serve_mocks(args.mock))
        return 0
    if args.quick:
        args.seconds, args.repeats, args.latency_requests = 1.5, 1, 500

    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_router_logs"
    logdir.mkdir(exist_ok=True)
    direct, prefill, decode = free_port(), free_port(), free_port()
    mocks = spawn([sys.executable, __file__, "--mock", str(direct), str(prefill), str(decode)],
                  logdir / "mocks.log")
    targets = [Target("direct to mock", direct)]
    try:
        wait_ready(f"http://127.0.0.1:{direct}/health")
        targets.append(start_pdserve(prefill, decode, logdir))
        sglang = sglang_command(args.sglang_router) if args.sglang_router else None
        if sglang:
            targets.append(start_sglang(sglang, prefill, decode, logdir))
        print(f"# router benchmark - {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"# machine: {cpu_model()}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f}; Python {sys.version.split()[0]}")
        if sglang:
            print(f"# sglang-router {sglang_version(sglang)}: {' '.join(sglang)}")
        print(f"# {args.connections} connections x {args.seconds:g} s (best of {args.repeats});"
              f" latency: {args.latency_requests} requests on 1 keep-alive connection")
        results = asyncio.run(measure(targets, args))
        base = results["direct to mock"]
        print()
        print("| target | mode | req/s @ %d conns | p50 ms @ 1 conn | p99 ms | added p50 ms |"
              % args.connections)
        print("|---|---|---:|---:|---:|---:|")
        for name, row in results.items():
            for mode in ("unary", "stream"):
                r = row[mode]
                added = (r["p50"] - base[mode]["p50"]) * 1e3
                print(f"| {name} | {'streaming' if mode == 'stream' else 'non-streaming'} | "
                      f"{r['rps']:.0f} | {r['p50'] * 1e3:.3f} | {r['p99'] * 1e3:.3f} | "
                      f"{'-' if name == 'direct to mock' else f'{added:.3f}'} |")
        if "sglang-router" in results and not args.latency_only:
            for mode in ("unary", "stream"):
                ours, theirs = results["pdserve router"], results["sglang-router"]
                ratio = ours[mode]["rps"] / theirs[mode]["rps"]
                print(f"# pdserve / sglang-router throughput, {mode}: {ratio:.2f}x")
    finally:
        for target in targets:
            target.stop()
        os.killpg(mocks.pid, signal.SIGTERM) if mocks.poll() is None else None
        mocks.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
