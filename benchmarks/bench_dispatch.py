"""DP controller: dispatch throughput, per-hop latency, and balance quality of the four methods.

    python benchmarks/bench_dispatch.py            # full run, about two minutes on 2 cores
    python benchmarks/bench_dispatch.py --quick    # a few seconds (used by the test)
    python benchmarks/bench_dispatch.py --skip-controller     # balance simulation only

Part 1, the real controller process (SPEC section 2). A "front end" (this process) writes
exactly what `FrontEnd(via_controller=True)` sends: `scheduler_input.controller_frames`, i.e.
[routing header, GenerateRequest] messages on the controller's Unix stream socket
(`common/server/frame_stream.py`; random `bootstrap_room` for
follow_bootstrap_room), to the real `run_controller_process` (the launcher's target:
`Dispatcher` + `ControllerLoop`), one per method, started with multiprocessing spawn, 4 ranks, a
real shared-memory `LoadBoard`. The "schedulers" are 4 PULL sockets in one receiver process that
take every message at once and timestamp it, and publish a fresh snapshot per rank to the board
every 5 ms, so the load-aware methods really refresh from it. The front end (this process)
binds `frontend_input` and counts the controllers' `DispatchReport`s, as a service's does.
Three baseline forwarders wired the same way split the controller's cost: a bare ZMQ PULL ->
PUSH relay of single-frame requests (the floor of any Python forwarder behind ZMQ); the
[header, request] frames on a ZMQ PULL with the header decoded and the request frame forwarded
(the previous controller's transport, minus the Dispatcher); the same frames read from a Unix
stream socket in a blocking recv (the controller's transport, minus the Dispatcher).
`--reference REF` also runs the controller of commit REF (its `common/` from `git archive`, in a
subprocess), fed as that commit's front end fed it (ZMQ before the stream socket, single frames
before `controller_frames`): the before/after in one run.

* Throughput: N pre-encoded requests sent as fast as the controller takes them; dispatches/s
  = N / (last arrival at any scheduler socket - first send). Best and median of `--repeats`,
  the processes taking turns. Process CPU time (from /proc) per dispatch.
* Latency: one request at a time, send -> arrival at a scheduler socket (both timestamps on
  CLOCK_MONOTONIC, which every process shares). Each sample through a process is paired with
  a direct PUSH -> PULL sample (alternating which goes first, so both see the same machine
  noise); "added" = percentile(through the process) - percentile(direct).
* Profile: `ControllerLoop.run_forever` in this process on pre-queued requests: thread CPU per
  dispatch, a cProfile of where it goes, and the cost of each step measured alone (decode,
  Dispatcher, encode, send) with what-ifs for a cheaper decode.

Part 2, balance quality (in process, deterministic with `--seed`). A mixed workload (80 %
50-200 tokens, 20 % 2,000-8,000 tokens; Poisson background plus Poisson bursts of 16-64
requests a fraction of a millisecond apart) is replayed against the REAL `Dispatcher` with a
fake clock and a fake board. Each simulated rank is a FIFO, chunked-prefill-like scheduler:
it serves `--rank-tokens-per-s` tokens per second in steps of at most `--chunk` tokens, and
reads its socket only between steps (an idle rank reads at once), so a busy rank's newest
requests are not yet in its own queue. Every 5 ms each rank publishes a snapshot of its own
view to the board; the Dispatcher refreshes from it at most every 20 ms. Sampled every 1 ms:
max/mean across ranks of the outstanding requests and outstanding tokens (dispatched and not
finished, read or not), over the samples with at least one outstanding request per rank on
average (below that the ratio is dominated by 1-of-1 cases).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import heapq
import multiprocessing
import os
import platform
import pstats
import random
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
# `common` without installing; this folder so that spawned children can import this module.
for _p in (REPO_ROOT, BENCH_DIR):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import msgspec  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
import zmq  # noqa: E402

from common.config import ServerArgs  # noqa: E402
from common.dp.controller import ControllerLoop, run_controller_process  # noqa: E402
from common.dp.dispatch import LOAD_AWARE, METHODS, DispatchItem, Dispatcher  # noqa: E402
from common.loads.board import LoadBoard  # noqa: E402
from common.loads.snapshot import LoadSnapshot  # noqa: E402
from common.messages import launch, scheduler_input  # noqa: E402
from common.messages.sampling import SamplingParams  # noqa: E402
from common.messages.scheduler_input import GenerateRequest  # noqa: E402
from common.server import frame_stream  # noqa: E402
from common.server.ipc import IpcPaths  # noqa: E402
from common.server.process_utils import die_with_parent  # noqa: E402

NUM_RANKS = 4
TARGET_DISPATCH_PER_S = 20_000
TARGET_ADDED_P50_US = 100.0
SNAPSHOT_PERIOD_S = 0.005
REFRESH_INTERVAL_S = 0.02
BUSY_PER_RANK = 8  # "worst while busy": samples with >= 8 outstanding requests per rank
ECHO = struct.Struct("<qB")  # arrival time (ns, CLOCK_MONOTONIC), rank
now_ns = time.monotonic_ns


# ---------------------------------------------------------------------------------- helpers


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of a process, all threads (ns resolution from schedstat; else clock ticks),
    0 if unreadable."""
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_requests(
    n: int, method: str, prompt_tokens: int, rng: random.Random, prefix: str = "r"
) -> list[GenerateRequest]:
    """GenerateRequests as the HTTP layer builds them (fresh rid, random prompt ids)."""
    sampling = SamplingParams(max_new_tokens=16)
    ids = [rng.randrange(32_000) for _ in range(prompt_tokens)]
    out = []
    for i in range(n):
        room = rng.getrandbits(63) if method == "follow_bootstrap_room" else None
        out.append(GenerateRequest(
            rid=f"{prefix}{i:08x}", input_ids=ids, sampling=sampling, bootstrap_room=room
        ))
    return out


# How requests are framed: "controller" = what FrontEnd(via_controller=True) sends, built by
# the same function; "single" = one frame per request (dp_size 1's direct path to a scheduler,
# and the controller's input before the routing header frame).
FRAMINGS = ("controller", "single")


def frame_requests(reqs: list[GenerateRequest], framing: str) -> list[list[bytes]]:
    """One multipart message (a list of frames) per request."""
    if framing == "controller":
        return [scheduler_input.controller_frames([r]) for r in reqs]
    return [[scheduler_input.encoder.encode(r)] for r in reqs]


def make_messages(n: int, method: str, prompt_tokens: int, rng: random.Random,
                  prefix: str = "r", framing: str = "controller") -> list[list[bytes]]:
    return frame_requests(make_requests(n, method, prompt_tokens, rng, prefix), framing)


class WholeRequestRoute(msgspec.Struct, tag="generate", kw_only=True, frozen=True):
    """The previous controller's view of a single-frame request: the routing fields, the prompt
    left encoded (msgspec still walks it to skip it) and only its length read."""

    rid: str
    input_ids: msgspec.Raw
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


whole_request_route_decoder = msgspec.msgpack.Decoder(WholeRequestRoute)


def encoded_array_len(raw: msgspec.Raw) -> int:
    """Element count of an encoded msgpack array, read from its header."""
    data = memoryview(raw)
    head = data[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(data[1:3], "big")
    return int.from_bytes(data[1:5], "big")


# ------------------------------------------------------------- part 1: the receiver process


def receiver_main(ipc: IpcPaths, control_addr: str, board_path: str, board_id: int,
                  num_ranks: int) -> None:
    """The 4 "schedulers" (PULL, answer at once). The controllers' DispatchReports go to the
    front end (the Rig, in the main process), as in a service: not here, where they would
    compete with the arrivals being timed.

    Commands on the PAIR control socket (msgpack lists):
      ["count", n]  reply ["ready"]; after n scheduler arrivals reply
                    ["counted", first_ns, last_ns, per-rank counts]
      ["echo"]      reply ["ready"]; then every arrival is echoed as ECHO(ns, rank)
      ["idle"]      reply ["ready"]; arrivals are only counted
      ["stats"]     reply ["stats", arrivals]
      ["quit"]      exit
    """
    die_with_parent()
    ctx = zmq.Context()
    control = ctx.socket(zmq.PAIR)
    control.connect(control_addr)
    scheds = []
    for rank in range(num_ranks):
        s = ctx.socket(zmq.PULL)
        s.bind(ipc.scheduler_input_of(rank))
        scheds.append(s)
    board = LoadBoard.attach(board_path, num_ranks, board_id)
    poller = zmq.Poller()
    for s in (*scheds, control):
        poller.register(s, zmq.POLLIN)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    mode, target, count, first, last = "idle", 0, 0, 0, 0
    counts = [0] * num_ranks
    arrivals = 0
    next_publish = 0.0
    control.send(enc.encode(["ready"]))
    while True:
        events = dict(poller.poll(5))
        for rank, s in enumerate(scheds):
            if s not in events:
                continue
            while True:
                try:
                    s.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                t = now_ns()
                arrivals += 1
                if mode == "echo":
                    control.send(ECHO.pack(t, rank))
                elif mode == "count":
                    if count == 0:
                        first = t
                    last = t
                    count += 1
                    counts[rank] += 1
                    if count == target:
                        control.send(enc.encode(["counted", first, last, counts]))
                        mode = "idle"
        if control in events:
            cmd = dec.decode(control.recv())
            if cmd[0] == "quit":
                break
            if cmd[0] == "count":
                mode, target, count = "count", cmd[1], 0
                counts = [0] * num_ranks
                control.send(enc.encode(["ready"]))
            elif cmd[0] in ("echo", "idle"):
                mode = cmd[0]
                control.send(enc.encode(["ready"]))
            elif cmd[0] == "stats":
                control.send(enc.encode(["stats", arrivals]))
        mono = time.monotonic()
        if mono >= next_publish:  # schedulers that answer at once: empty queues, fresh stamps
            wall = time.time()
            for rank in range(num_ranks):
                board.write(LoadSnapshot(dp_rank=rank, timestamp=wall))
            next_publish = mono + SNAPSHOT_PERIOD_S
    board.close()
    ctx.destroy(linger=0)


@dataclass
class ThroughputResult:
    n: int
    seconds: list[float]  # first send -> last arrival, per repeat
    send_seconds: list[float]  # first send -> last send returned
    ctrl_cpu_us: list[float]  # controller CPU per dispatch
    per_rank: list[int]

    @property
    def best(self) -> float:
        return self.n / min(self.seconds)

    @property
    def median(self) -> float:
        return self.n / statistics.median(self.seconds)


@dataclass
class LatencyResult:
    via_us: list[float]
    direct_us: list[float]


@dataclass
class MethodResult:
    method: str
    throughput: ThroughputResult
    latency: LatencyResult
    reports_ok: bool | None  # every dispatch in a DispatchReport (None: a baseline relay)
    long_throughput: ThroughputResult | None = None  # with --long-prompt-tokens prompts


# Python forwarders that do part of the controller's work, to split its cost (same wiring).
RELAYS = {
    "plain": "baseline: ZMQ relay, recv -> send",
    "header": "baseline: ZMQ relay, [header, request] + header decode",
    "stream": "baseline: stream relay, [header, request] + header decode",
}
RELAY_FRAMING = {"plain": "single", "header": "controller", "stream": "controller"}
RELAY_TRANSPORT = {"plain": "zmq", "header": "zmq", "stream": "stream"}


def relay_main(kind: str, in_addr: str, out_addrs: list[str], report_addr: str, ready) -> None:
    """Forward every request to the next rank. "plain": single-frame requests on a ZMQ PULL,
    blocking recv -> send, nothing decoded (the floor of any Python forwarder behind ZMQ);
    "header": [header, request] messages on a ZMQ PULL, the header decoded, the request frame
    forwarded zero-copy (the previous controller without its Dispatcher); "stream": the same
    messages read from a Unix stream socket in a blocking recv(), as the controller reads them (the
    controller without its Dispatcher and reports)."""
    die_with_parent()
    ctx = zmq.Context()
    outs = []
    for addr in out_addrs:
        s = ctx.socket(zmq.PUSH)
        s.connect(addr)
        outs.append(s)
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(report_addr)
    route = scheduler_input.route_decoder.decode
    i, n = 0, len(outs)
    if kind == "stream":
        listener = frame_stream.listen(in_addr)
        ready.send_bytes(b"ready")
        ready.close()
        conn, _ = listener.accept()
        reader = frame_stream.FrameReader(conn)
        conn.setblocking(True)  # as the controller serves its one front end: recv() blocks
        while True:
            messages = reader.read()
            if messages is None:
                return
            for head, body in messages:
                route(head)
                outs[i].send(body)
                i = (i + 1) % n
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    ready.send_bytes(b"ready")
    ready.close()
    recv = pull.recv
    if kind == "plain":
        while True:
            outs[i].send(recv())
            i = (i + 1) % n
    while True:  # "header", as the previous controller: frames, `.more`, zero-copy forward
        head = recv(copy=False)
        if head.more:
            body = recv(copy=False)
            if not body.more:
                route(head)
                outs[i].send(body, copy=False)
                i = (i + 1) % n


REFERENCE_CHILD = """
import json, sys
from multiprocessing.connection import Connection
cfg = json.loads(sys.argv[1])
import common
assert common.__file__.startswith(cfg["root"]), common.__file__
from common.config import ServerArgs
from common.dp.controller import run_controller_process
from common.server.ipc import IpcPaths
args = ServerArgs(dp_size=cfg["ranks"], load_balance_method=cfg["method"],
                  load_refresh_interval=cfg["refresh"], log_level="warning")
run_controller_process(args, cfg["method"], IpcPaths(**cfg["ipc"]), cfg["board_path"],
                       cfg["board_id"], Connection(cfg["fd"]))
"""


@dataclass
class Reference:
    """The controller of another commit: its `common/` extracted into `root`."""

    ref: str
    sha: str
    root: str
    framing: str
    transport: str  # how its controller takes input: "stream" (frame_stream) or "zmq"


def extract_reference(ref: str, tmpdir: str) -> Reference:
    import io
    import subprocess
    import tarfile

    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    root = tempfile.mkdtemp(prefix="reference-", dir=tmpdir)
    archive = subprocess.run(["git", "archive", sha, "common"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root)
    src = (Path(root) / "common" / "messages" / "scheduler_input.py").read_text()
    transport = "stream" if (Path(root) / "common" / "server" / "frame_stream.py").exists() \
        else "zmq"
    return Reference(ref, sha, root, "controller" if "def controller_frames" in src else "single",
                     transport)


class ChildProcess:
    """A subprocess.Popen with the multiprocessing.Process methods the Rig uses."""

    def __init__(self, popen):
        self.popen = popen
        self.pid = popen.pid

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self.popen.poll() is None


class StreamFeeder:
    """The front end's end of a controller's stream socket, with a ZMQ socket's method names
    (blocking: a controller that falls behind slows the sender, as a ZMQ high-water mark
    does)."""

    def __init__(self, path: str):
        self.sock = frame_stream.connect(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sock.sendmsg(frame_stream.encode_message(frames))

    def close(self, linger: int = 0) -> None:
        self.sock.close()


@dataclass
class Endpoint:
    name: str
    tag: str  # first character of the rids sent to it (reports are counted per tag)
    proc: multiprocessing.process.BaseProcess | ChildProcess
    push: zmq.Socket | StreamFeeder
    framing: str = "controller"  # how its front end frames requests (FRAMINGS)
    method: str = "round_robin"  # the requests it gets (random rooms for follow_bootstrap_room)


class Rig:
    """The receiver process, and the controllers (all started, one driven at a time: runs of
    the methods interleave, so each sees the same machine noise) plus the bare relay."""

    def __init__(self, tmpdir: str):
        self.mp = multiprocessing.get_context("spawn")
        self.folder = tempfile.mkdtemp(prefix="ipc-", dir=tmpdir)
        self.base = IpcPaths(
            folder=self.folder,
            controller_input=f"ipc://{self.folder}/controller",
            detokenizer_input=f"ipc://{self.folder}/detokenizer",
            frontend_input=f"ipc://{self.folder}/frontend",
        )
        self.board = LoadBoard.create(NUM_RANKS, directory=tmpdir)
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PAIR)
        control_addr = f"ipc://{self.folder}/bench-control"
        self.control.bind(control_addr)
        self.receiver = self.mp.Process(
            target=receiver_main,
            args=(self.base, control_addr, self.board.path, self.board.board_id, NUM_RANKS),
            name="bench-receiver", daemon=True,
        )
        self.receiver.start()
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self._expect("ready", timeout=60)
        self.direct = self.ctx.socket(zmq.PUSH)
        self.direct.connect(self.base.scheduler_input_of(0))
        # The front end's inbox: the controllers' DispatchReports (drained between runs, so a
        # full inbox never blocks a controller).
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.RCVHWM, 0)
        self.reports.bind(self.base.frontend_input)
        self.report_rids: dict[str, int] = {}
        self.report_failed = 0
        self.endpoints: list[Endpoint] = []

    # ---- control channel ----------------------------------------------------------------
    def _recv(self, timeout: float = 30.0) -> bytes:
        if not self.control.poll(int(timeout * 1000)):
            raise TimeoutError("the receiver process did not answer")
        return self.control.recv()

    def _expect(self, tag: str, timeout: float = 30.0) -> list:
        msg = self.dec.decode(self._recv(timeout))
        if msg[0] != tag:
            raise RuntimeError(f"receiver said {msg!r}, expected {tag!r}")
        return msg

    def _command(self, *cmd) -> None:
        self.control.send(self.enc.encode(list(cmd)))
        self._expect("ready")

    # ---- the processes under test -----------------------------------------------------------
    def _wait_started(self, proc, reader, what: str) -> bytes:
        if not reader.poll(60):
            proc.kill()
            raise TimeoutError(f"{what} did not start")
        return reader.recv_bytes()

    def start_controller(self, method: str, tag: str) -> Endpoint:
        """The launcher's own target, `run_controller_process`, as the launcher starts it."""
        ipc = IpcPaths(
            folder=self.folder,
            controller_input=f"{self.folder}/controller-{method}.sock",
            detokenizer_input=self.base.detokenizer_input,
            frontend_input=self.base.frontend_input,
        )
        args = ServerArgs(dp_size=NUM_RANKS, load_balance_method=method,
                          load_refresh_interval=REFRESH_INTERVAL_S, log_level="warning")
        reader, writer = self.mp.Pipe(duplex=False)
        proc = self.mp.Process(
            target=run_controller_process,
            args=(args, method, ipc, self.board.path, self.board.board_id, writer),
            name=f"bench-controller-{method}", daemon=True,
        )
        proc.start()
        writer.close()
        ready = launch.decoder.decode(self._wait_started(proc, reader, "the controller"))
        if not isinstance(ready, launch.ProcessReady):
            raise RuntimeError(f"controller failed to start: {ready}")
        return self._add(method, tag, proc, ipc.controller_input, method=method,
                         transport="stream")

    def start_reference(self, ref: Reference, method: str, tag: str) -> Endpoint:
        """The controller of another commit, in a subprocess importing that commit's code."""
        import dataclasses
        import json
        import subprocess

        where = f"{self.folder}/reference-{method}"
        ipc = IpcPaths(
            folder=self.folder,
            controller_input=f"{where}.sock" if ref.transport == "stream" else f"ipc://{where}",
            detokenizer_input=self.base.detokenizer_input,
            frontend_input=self.base.frontend_input,
        )
        reader, writer = self.mp.Pipe(duplex=False)
        cfg = {"root": ref.root, "ranks": NUM_RANKS, "method": method,
               "refresh": REFRESH_INTERVAL_S, "ipc": dataclasses.asdict(ipc),
               "board_path": self.board.path, "board_id": self.board.board_id,
               "fd": writer.fileno()}
        env = {**os.environ, "PYTHONPATH": ref.root}
        proc = ChildProcess(subprocess.Popen(
            [sys.executable, "-c", REFERENCE_CHILD, json.dumps(cfg)], cwd=ref.root, env=env,
            pass_fds=(writer.fileno(),),
        ))
        writer.close()
        ready = launch.decoder.decode(self._wait_started(proc, reader, "the reference"))
        if not isinstance(ready, launch.ProcessReady):
            raise RuntimeError(f"reference controller failed to start: {ready}")
        return self._add(f"{method} @ {ref.sha}", tag, proc, ipc.controller_input,
                         framing=ref.framing, method=method, transport=ref.transport)

    def start_relay(self, kind: str, tag: str) -> Endpoint:
        transport = RELAY_TRANSPORT[kind]
        addr = (f"{self.folder}/relay-{kind}.sock" if transport == "stream"
                else f"ipc://{self.folder}/relay-{kind}")
        reader, writer = self.mp.Pipe(duplex=False)
        outs = [self.base.scheduler_input_of(r) for r in range(NUM_RANKS)]
        proc = self.mp.Process(target=relay_main,
                               args=(kind, addr, outs, self.base.frontend_input, writer),
                               name=f"bench-relay-{kind}", daemon=True)
        proc.start()
        writer.close()
        self._wait_started(proc, reader, "the relay")
        return self._add(RELAYS[kind], tag, proc, addr, framing=RELAY_FRAMING[kind],
                         transport=transport)

    def _add(self, name: str, tag: str, proc, addr: str, framing: str = "controller",
             method: str = "round_robin", transport: str = "zmq") -> Endpoint:
        if transport == "stream":
            push = StreamFeeder(addr)
        else:
            push = self.ctx.socket(zmq.PUSH)
            push.connect(addr)
        ep = Endpoint(name, tag, proc, push, framing, method)
        self.endpoints.append(ep)
        return ep

    # ---- measurements -----------------------------------------------------------------------
    def throughput_once(self, ep: Endpoint, msgs: list[list[bytes]]
                        ) -> tuple[float, float, float, list[int]]:
        self.control.send(self.enc.encode(["count", len(msgs)]))
        self._expect("ready")
        cpu0 = proc_cpu_s(ep.proc.pid)
        send = ep.push.send_multipart
        t0 = now_ns()
        for frames in msgs:
            send(frames)
        t_sent = now_ns()
        _, first, last, counts = self._expect("counted", timeout=120)
        cpu = proc_cpu_s(ep.proc.pid) - cpu0
        self.drain_reports()
        return (last - t0) / 1e9, (t_sent - t0) / 1e9, cpu, counts

    def latency(self, eps: list[Endpoint], via_msgs: dict[str, list[list[bytes]]],
                direct_msgs: list[list[bytes]], gap_s: float, block: int = 100
                ) -> dict[str, LatencyResult]:
        """Blocks of `block` requests per endpoint, the endpoints taking turns (so slow drift
        of the machine's load hits them all alike, while each is measured warm, as under a
        steady trickle of requests). Each request through an endpoint is paired with a direct
        sample, alternating which goes first, with `gap_s` of quiet before each send, so the
        side traffic of the previous one (a DispatchReport, the receiver handling it) is over.
        The controller's deferred reports go every REPORT_DELAY_MS (10 ms), one per ~9 of these
        requests, right after a forward (so in a via sample)."""
        self._command("echo")
        out = {ep.name: LatencyResult([], []) for ep in eps}
        direct_iter = iter(direct_msgs)
        n = min(len(v) for v in via_msgs.values())
        for start in range(0, n, block):
            for ep in eps:
                res = out[ep.name]
                for i in range(start, min(n, start + block)):
                    order = ((ep.push, via_msgs[ep.name][i], res.via_us),
                             (self.direct, next(direct_iter), res.direct_us))
                    for sock, frames, sink in (order[::-1] if i % 2 else order):
                        time.sleep(gap_s)
                        t = now_ns()
                        sock.send_multipart(frames)
                        arrival, _rank = ECHO.unpack(self._recv(10))
                        sink.append((arrival - t) / 1e3)
                self.drain_reports()
        self._command("idle")
        return out

    def drain_reports(self) -> None:
        """Count the DispatchReports received so far (rids per tag, failures)."""
        from common.messages import frontend_input

        while True:
            try:
                raw = self.reports.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = frontend_input.decoder.decode(raw)
            if isinstance(msg, frontend_input.DispatchReport):
                for rid in msg.rids:
                    self.report_rids[rid[0]] = self.report_rids.get(rid[0], 0) + 1
                self.report_failed += len(msg.failed)

    def report_stats(self) -> tuple[dict[str, int], int, int]:
        """DispatchReport rids per tag, failures, scheduler arrivals."""
        self.drain_reports()
        self.control.send(self.enc.encode(["stats"]))
        _, arrivals = self._expect("stats")
        return dict(self.report_rids), self.report_failed, arrivals

    def close(self) -> None:
        for ep in self.endpoints:
            ep.push.close(linger=0)
            ep.proc.terminate()
        for ep in self.endpoints:
            ep.proc.join(5)
            if ep.proc.is_alive():
                ep.proc.kill()
                ep.proc.join(5)
        try:
            self.control.send(self.enc.encode(["quit"]))
        except zmq.ZMQError:
            pass
        self.receiver.join(5)
        if self.receiver.is_alive():
            self.receiver.terminate()
            self.receiver.join(5)
        self.ctx.destroy(linger=0)
        self.board.unlink()


def latency_block(ns: argparse.Namespace) -> int:
    return max(10, min(100, ns.latency_samples // 10))


def bench_controllers(rig: Rig, ns: argparse.Namespace, rng: random.Random, log,
                      reference: Reference | None = None) -> list[MethodResult]:
    eps = [rig.start_controller(m, tag) for m, tag in zip(METHODS, "abcd")]
    if reference is not None:
        eps += [rig.start_reference(reference, m, tag) for m, tag in zip(METHODS, "efgh")]
    eps += [rig.start_relay(kind, tag) for kind, tag in zip(RELAYS, "xyz")]
    controllers = [ep for ep in eps if not ep.name.startswith("baseline")]
    sent = {ep.tag: 0 for ep in eps}

    def requests(ep: Endpoint, n: int, kind: str, tokens: int = ns.prompt_tokens
                 ) -> list[list[bytes]]:
        sent[ep.tag] += n
        return make_messages(n, ep.method, tokens, rng, f"{ep.tag}{kind}", ep.framing)

    def summarize(r: list[tuple[float, float, float, list[int]]], n: int) -> ThroughputResult:
        return ThroughputResult(
            n, [x[0] for x in r], [x[1] for x in r], [x[2] / n * 1e6 for x in r],
            [sum(x[3][k] for x in r) for k in range(NUM_RANKS)],
        )

    # Warm-up: the connections, each controller's first board read, the allocators.
    for ep in eps:
        rig.throughput_once(ep, requests(ep, ns.warmup, "w"))
    runs: dict[str, list[tuple[float, float, float, list[int]]]] = {ep.name: [] for ep in eps}
    for rep in range(ns.repeats):
        for ep in eps[rep % len(eps):] + eps[:rep % len(eps)]:  # rotate who goes first
            runs[ep.name].append(rig.throughput_once(ep, requests(ep, ns.requests, f"t{rep}-")))
    long_runs: dict[str, list[tuple[float, float, float, list[int]]]] = {e.name: [] for e in eps}
    for rep in range(ns.repeats if ns.long_prompt_tokens else 0):
        for ep in eps[rep % len(eps):] + eps[:rep % len(eps)]:
            msgs = requests(ep, ns.long_requests, f"L{rep}-", ns.long_prompt_tokens)
            long_runs[ep.name].append(rig.throughput_once(ep, msgs))
    log("throughput done")
    n = ns.latency_samples
    via = {ep.name: requests(ep, n, "l") for ep in eps}
    direct = make_messages(n * len(eps), "round_robin", ns.prompt_tokens, rng, "_d", "single")
    block = latency_block(ns)
    for ep in eps:  # warm-up, not kept
        rig.latency([ep], {ep.name: requests(ep, block, "lw")}, direct[:block], 0.0)
    latencies = rig.latency(eps, via, direct, ns.latency_gap_us * 1e-6, block)
    log("latency done")
    # Every dispatch must also be in a DispatchReport (the controller's other output).
    deadline = time.monotonic() + 10
    while True:
        rids, failed, _ = rig.report_stats()
        complete = {ep.tag: rids.get(ep.tag, 0) == sent[ep.tag] for ep in controllers}
        if (all(complete.values()) and failed == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    for ep in eps:
        tp = summarize(runs[ep.name], ns.requests)
        long_tp = summarize(long_runs[ep.name], ns.long_requests) if long_runs[ep.name] else None
        ok = complete[ep.tag] and failed == 0 if ep in controllers else None
        out.append(MethodResult(ep.name, tp, latencies[ep.name], ok, long_tp))
        log(f"{ep.name}: best {tp.best:,.0f}/s, p50 "
            f"{percentile(latencies[ep.name].via_us, 50):.0f} us")
    return out


# --------------------------------------------------------------- part 1: in-process profile


class _Done(BaseException):
    pass


STOP_ID = "bench-stop"


@dataclass
class ProfileResult:
    method: str
    n: int
    thread_cpu_us: dict[str, float]  # per method: controller thread CPU per dispatch
    wall_us: dict[str, float]
    long_tokens: int
    long_cpu_us: dict[str, float]  # the same with long prompts
    long_wall_us: dict[str, float]
    top: list[tuple[str, float, float, int]]  # (function, tottime us/dispatch, cum, calls)
    components: list[tuple[str, float, str]]  # (step, us per call, note)


class InProcessController:
    """A real ControllerLoop in this process, its peers bound by sinks nobody drains (the
    context's high-water marks are unlimited, so nothing blocks)."""

    def __init__(self, method: str, tmpdir: str, board: LoadBoard):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.SNDHWM, 0)
        self.ctx.setsockopt(zmq.RCVHWM, 0)
        folder = tempfile.mkdtemp(prefix="ipc-prof-", dir=tmpdir)
        self.ipc = IpcPaths(folder=folder, controller_input=f"{folder}/controller.sock",
                            detokenizer_input=f"ipc://{folder}/detok",
                            frontend_input=f"ipc://{folder}/frontend")
        self.sinks = []
        for rank in range(NUM_RANKS):
            s = self.ctx.socket(zmq.PULL)
            s.bind(self.ipc.scheduler_input_of(rank))
            self.sinks.append(s)
        s = self.ctx.socket(zmq.PULL)
        s.bind(self.ipc.frontend_input)
        self.sinks.append(s)
        dispatcher = Dispatcher(method, NUM_RANKS, NUM_RANKS, read_loads=board.read_all,
                                refresh_interval=REFRESH_INTERVAL_S)
        self.loop = ControllerLoop(dispatcher, self.ipc, ctx=self.ctx)
        self.feed = frame_stream.connect(self.ipc.controller_input)
        loop = self.loop
        handle_control = loop.handle_control
        self.stop = scheduler_input.encoder.encode(scheduler_input.StatsRequest(request_id=STOP_ID))
        stop = self.stop

        def control_or_stop(raw) -> None:  # the sentinel queued after the requests ends a run
            if raw == stop:
                raise _Done
            handle_control(raw)

        loop.handle_control = control_or_stop

    def run(self, msgs: list[list[bytes]], profiler: cProfile.Profile | None = None
            ) -> tuple[float, float]:
        """Run the real run_forever until msgs are all dispatched: thread CPU s, wall s. A
        thread writes them, pre-encoded as one buffer, into the controller's input socket as
        fast as it reads (one sendall: the writer holds the GIL only between kernel calls)."""
        import threading

        blob = b"".join(b for frames in [*msgs, [self.stop]]
                        for b in frame_stream.encode_message(frames))
        writer = threading.Thread(target=self.feed.sendall, args=(blob,), daemon=True)
        gc.collect()  # this benchmark's garbage, not the controller's
        writer.start()
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            if profiler is not None:
                profiler.runcall(self.loop.run_forever)
            else:
                self.loop.run_forever()
        except _Done:
            pass
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        writer.join()
        return cpu, wall

    def drain(self) -> None:
        """Empty the sinks (untimed), so memory does not grow from run to run."""
        time.sleep(0.02)
        for s in self.sinks:
            while True:
                try:
                    s.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break

    def close(self) -> None:
        self.feed.close()
        self.loop.listener.close()
        self.ctx.destroy(linger=0)


def component_costs(reqs: list[GenerateRequest], long_reqs: list[GenerateRequest], tmpdir: str,
                    board: LoadBoard) -> list[tuple[str, float, str]]:
    """Each step of one dispatch, timed alone, best of 3."""
    n, long_n = len(reqs), len(long_reqs)
    prompt, long_prompt = len(reqs[0].input_ids), len(long_reqs[0].input_ids)
    enc = scheduler_input.encoder.encode
    bodies, long_bodies = [enc(r) for r in reqs], [enc(r) for r in long_reqs]
    frames = frame_requests(reqs, "controller")
    long_frames = frame_requests(long_reqs, "controller")
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 0)
    ctx.setsockopt(zmq.RCVHWM, 0)
    folder = tempfile.mkdtemp(prefix="ipc-comp-", dir=tmpdir)
    sink = ctx.socket(zmq.PULL)
    sink.bind(f"ipc://{folder}/sink")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{folder}/sink")

    def decode(k, src=bodies):
        d = scheduler_input.decoder.decode
        for m in src[:k]:
            d(m)

    def encode(k, src=reqs):
        e = scheduler_input.encoder.encode
        for r in src[:k]:
            e(r)

    def send(k, src=bodies):
        for m in src[:k]:
            push.send(m)

    def front_end_frames(k, src=reqs):  # what FrontEnd(via_controller=True) encodes
        f = scheduler_input.controller_frames
        for r in src[:k]:
            f([r])

    def header(k, src=frames):  # the controller's only decode
        d = scheduler_input.route_decoder.decode
        for fr in src[:k]:
            d(fr[0])

    def whole(k, src=bodies):  # the controller's decode before the header frame
        d = whole_request_route_decoder.decode
        for m in src[:k]:
            encoded_array_len(d(m).input_ids)

    def relay_frames(src):
        """Read [header, request] messages from a Unix stream socket and send each request
        frame on: the controller's socket work per request. Fed in chunks the socket buffer
        holds, untimed; only the reads, the parsing and the sends are timed."""
        def run(k):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            reader = frame_stream.FrameReader(b)
            elapsed, i = 0.0, 0
            while i < k:
                chunk, size, count = [], 0, 0
                while i < k and size < 64 * 1024:
                    bufs = frame_stream.encode_message(src[i])
                    chunk += bufs
                    size += sum(len(x) for x in bufs)
                    i += 1
                    count += 1
                a.sendall(b"".join(chunk))
                t0 = time.perf_counter()
                while count:
                    for _head, body in reader.read():
                        count -= 1
                        push.send(body)
                elapsed += time.perf_counter() - t0
            a.close()
            b.close()
            return elapsed
        return run

    def dispatcher_for(method):
        disp = Dispatcher(method, NUM_RANKS, NUM_RANKS, read_loads=board.read_all,
                          refresh_interval=REFRESH_INTERVAL_S)

        def run(k):
            place = disp.place
            for r in reqs[:k]:
                place(len(r.input_ids), r.routed_dp_rank, r.bootstrap_room)
        return run

    def board_read(k):
        for _ in range(k):
            board.read_all()

    rows = [
        (f"msgspec decode GenerateRequest ({prompt} tokens)", decode, n,
         "whole message, prompt ids included (the scheduler's decode)"),
        (f"msgspec encode GenerateRequest ({prompt} tokens)", encode, n,
         "front end, dp_size 1"),
        (f"front end: controller_frames, {prompt} tokens", front_end_frames, n,
         "routing header + request encoded (dp_size > 1)"),
        (f"zmq PUSH send, ipc ({len(bodies[0])} bytes)", send, n,
         "pyzmq send of the encoded bytes"),
    ]
    rows += [(f"Dispatcher.place: {m}", dispatcher_for(m), n,
              "incl. board refresh every 20 ms" if m in LOAD_AWARE else "") for m in METHODS]
    rows += [
        ("LoadBoard.read_all (4 ranks)", board_read, max(200, n // 20),
         "once per 20 ms at most, per refresh"),
        (f"controller: decode the routing header frame ({len(frames[0][0])} bytes)", header, n,
         "RouteHeader: rid, num_tokens, routed_dp_rank, bootstrap_room"),
        (f"controller: read [header, request] + send request frame, {prompt} tokens",
         relay_frames(frames), n, "stream socket read and parse; the request frame copied"),
        (f"before: routing decode of the whole request, {prompt} tokens", whole, n,
         "input_ids as msgspec.Raw; length from its msgpack header"),
        (f"msgspec decode GenerateRequest ({long_prompt} tokens)",
         lambda k: decode(k, long_bodies), long_n, "a long prompt"),
        (f"msgspec encode GenerateRequest ({long_prompt} tokens)",
         lambda k: encode(k, long_reqs), long_n, ""),
        (f"front end: controller_frames, {long_prompt} tokens",
         lambda k: front_end_frames(k, long_reqs), long_n, ""),
        (f"zmq PUSH send, ipc ({len(long_bodies[0])} bytes)", lambda k: send(k, long_bodies),
         long_n, ""),
        (f"controller: decode the routing header frame, {long_prompt} tokens",
         lambda k: header(k, long_frames), long_n, "the same few bytes"),
        (f"controller: read [header, request] + send request frame, {long_prompt} tokens",
         relay_frames(long_frames), long_n, ""),
        (f"before: routing decode of the whole request, {long_prompt} tokens",
         lambda k: whole(k, long_bodies), long_n, "msgspec still walks the array to skip it"),
    ]
    out = []
    for name, fn, k, note in rows:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            timed = fn(k)  # a float: the function timed itself (untimed set-up)
            best = min(best, (timed if timed is not None else time.perf_counter() - t0) / k)
            while sink.poll(0):  # drain what send() queued
                sink.recv()
        out.append((name, best * 1e6, note))
    ctx.destroy(linger=0)
    return out


def profile_controller(ns: argparse.Namespace, tmpdir: str, rng: random.Random, log
                       ) -> ProfileResult:
    board = LoadBoard.create(NUM_RANKS, directory=tmpdir)
    for rank in range(NUM_RANKS):
        board.write(LoadSnapshot(dp_rank=rank, timestamp=time.time()))
    cpu, wall, long_cpu, long_wall = {}, {}, {}, {}
    prof_n = ns.profile_requests
    long_n = max(100, prof_n // 4)
    long_tokens = ns.long_prompt_tokens or 2048
    top: list[tuple[str, float, float, int]] = []
    ctls: dict[str, InProcessController] = {}
    try:
        for method in METHODS:
            ctls[method] = ctl = InProcessController(method, tmpdir, board)
            ctl.run(make_messages(ns.warmup, method, ns.prompt_tokens, rng, "w"))
            ctl.drain()
            cpu[method] = wall[method] = float("inf")
            long_cpu[method] = long_wall[method] = float("inf")
        for _ in range(ns.repeats):  # interleaved, best of the repeats per method
            for method, ctl in ctls.items():
                c, w = ctl.run(make_messages(prof_n, method, ns.prompt_tokens, rng))
                ctl.drain()
                cpu[method] = min(cpu[method], c / prof_n * 1e6)
                wall[method] = min(wall[method], w / prof_n * 1e6)
                c, w = ctl.run(make_messages(long_n, method, long_tokens, rng))
                ctl.drain()
                long_cpu[method] = min(long_cpu[method], c / long_n * 1e6)
                long_wall[method] = min(long_wall[method], w / long_n * 1e6)
        prof = cProfile.Profile()
        ctl = ctls[ns.profile_method]
        ctl.run(make_messages(prof_n, ns.profile_method, ns.prompt_tokens, rng), prof)
        top = _top_functions(prof, prof_n)
        for ctl in ctls.values():
            ctl.close()
        ctls.clear()
        log("in-process profile done")
        comps = component_costs(
            make_requests(prof_n, "follow_bootstrap_room", ns.prompt_tokens, rng),
            make_requests(long_n, "follow_bootstrap_room", long_tokens, rng),
            tmpdir, board,
        )
    finally:
        for ctl in ctls.values():
            ctl.close()
        board.unlink()
    return ProfileResult(ns.profile_method, prof_n, cpu, wall, long_tokens, long_cpu, long_wall,
                         top, comps)


def _top_functions(prof: cProfile.Profile, n: int, k: int = 12
                   ) -> list[tuple[str, float, float, int]]:
    stats = pstats.Stats(prof)
    rows = []
    for (filename, line, func), (_cc, calls, tt, ct, _callers) in stats.stats.items():
        if filename == "~":
            name = func.strip("<>").replace("built-in method ", "")
        else:
            p = Path(filename)
            parts = p.parts
            short = "/".join(parts[-2:]) if len(parts) >= 2 else p.name
            if "site-packages" in parts:
                short = "/".join(parts[parts.index("site-packages") + 1:])
            name = f"{short}:{line}({func})"
        rows.append((name, tt / n * 1e6, ct / n * 1e6, calls))
    rows.sort(key=lambda r: r[1], reverse=True)
    return rows[:k]


# ------------------------------------------------------------------ part 2: balance simulator


@dataclass
class Workload:
    arrivals: list[float]
    tokens: list[int]
    rooms: list[int]
    duration: float
    rate: float  # requests per second, background and bursts together
    mean_tokens: float


def make_workload(ns: argparse.Namespace, seed: int) -> Workload:
    rng = random.Random(seed)
    short_lo, short_hi, long_lo, long_hi = 50, 200, 2000, 8000
    p_long = ns.long_fraction
    mean_tokens = (1 - p_long) * (short_lo + short_hi) / 2 + p_long * (long_lo + long_hi) / 2
    capacity_rps = NUM_RANKS * ns.rank_tokens_per_s / mean_tokens
    rate = ns.utilization * capacity_rps
    burst_size_mean = (ns.burst_min + ns.burst_max) / 2
    burst_rate = ns.burst_fraction * rate / burst_size_mean
    bg_rate = (1 - ns.burst_fraction) * rate
    times = []
    t = 0.0
    while True:
        t += rng.expovariate(bg_rate)
        if t >= ns.sim_seconds:
            break
        times.append(t)
    t = 0.0
    while True:
        t += rng.expovariate(burst_rate)
        if t >= ns.sim_seconds:
            break
        s = t
        for _ in range(rng.randint(ns.burst_min, ns.burst_max)):
            s += rng.expovariate(1.0 / ns.burst_gap_s)
            times.append(s)
    times.sort()
    tokens = [
        rng.randint(long_lo, long_hi) if rng.random() < p_long else rng.randint(short_lo, short_hi)
        for _ in times
    ]
    rooms = [rng.getrandbits(63) for _ in times]
    return Workload(times, tokens, rooms, ns.sim_seconds, rate, mean_tokens)


class _SimReq:
    __slots__ = ("arrival", "tokens", "remaining", "done")

    def __init__(self, arrival: float, tokens: int):
        self.arrival = arrival
        self.tokens = tokens
        self.remaining = tokens
        self.done = -1.0


class _SimRank:
    __slots__ = ("idx", "inbox", "queue", "step", "busy", "out_reqs", "out_tokens",
                 "vis_reqs", "vis_tokens")

    def __init__(self, idx: int):
        self.idx = idx
        self.inbox: list[_SimReq] = []  # dispatched, not yet read by the scheduler
        self.queue: deque[_SimReq] = deque()  # read, unfinished (FIFO)
        self.step: list[tuple[_SimReq, int]] = []
        self.busy = False
        self.out_reqs = self.out_tokens = 0  # the truth: dispatched and unfinished
        self.vis_reqs = self.vis_tokens = 0  # the scheduler's own view (what it publishes)

    def snapshot(self, t: float) -> LoadSnapshot:
        running = len(self.step) if self.busy else 0
        return LoadSnapshot(dp_rank=self.idx, timestamp=t, num_running_reqs=running,
                            num_waiting_reqs=self.vis_reqs - running,
                            num_total_tokens=self.vis_tokens)


@dataclass
class SimRaw:
    """One replay: the sampled ratios and each request's arrival -> finish time."""
    req_ratios: list[float]
    tok_ratios: list[float]
    totals: list[int]  # outstanding requests at each kept sample
    samples_total: int
    completion_ms: list[float]
    short_ms: list[float]  # requests of <= 200 tokens


@dataclass
class BalanceRow:
    label: str
    method: str
    refresh: str
    board: str
    # mean, share of samples >= 2, worst, worst while busy (>= BUSY_PER_RANK per rank)
    req_ratio: tuple[float, float, float, float]
    tok_ratio: tuple[float, float, float, float]
    samples: int
    samples_total: int
    completion_ms: tuple[float, float]  # p50, p99 arrival -> finished
    short_p99_ms: float


def simulate(wl: Workload, method: str, refresh_interval: float, ns: argparse.Namespace,
             live_board: bool = False) -> SimRaw:
    """Replay the workload against the real Dispatcher on simulated time."""
    ranks = [_SimRank(i) for i in range(NUM_RANKS)]
    clock_now = [0.0]
    board: list[LoadSnapshot | None] = [None] * NUM_RANKS

    def read_loads():
        if live_board:  # every rank republishes its (lagging) view on every read
            return [r.snapshot(clock_now[0]) for r in ranks]
        return list(board)

    disp = Dispatcher(method, NUM_RANKS, NUM_RANKS,
                      read_loads=read_loads if method in LOAD_AWARE else None,
                      refresh_interval=refresh_interval, clock=lambda: clock_now[0])
    chunk, rate = ns.chunk, float(ns.rank_tokens_per_s)
    events: list[tuple[float, int, int]] = []  # (step end, seq, rank)
    seq = 0

    def start_step(rank: _SimRank, t: float) -> None:
        nonlocal seq
        for req in rank.inbox:  # the scheduler reads its socket between steps
            rank.queue.append(req)
            rank.vis_reqs += 1
            rank.vis_tokens += req.tokens
        rank.inbox.clear()
        if not rank.queue:
            rank.busy = False
            rank.step = []
            return
        budget = chunk
        step = []
        for req in rank.queue:
            take = min(req.remaining, budget)
            step.append((req, take))
            budget -= take
            if budget == 0:
                break
        rank.step = step
        rank.busy = True
        seq += 1
        heapq.heappush(events, (t + (chunk - budget) / rate, seq, rank.idx))

    def end_step(rank: _SimRank, t: float) -> None:
        for req, take in rank.step:
            req.remaining -= take
            if req.remaining == 0:
                req.done = t
                rank.queue.popleft()  # steps take from the head: finished ones are a prefix
                rank.out_reqs -= 1
                rank.out_tokens -= req.tokens
                rank.vis_reqs -= 1
                rank.vis_tokens -= req.tokens
        start_step(rank, t)

    reqs = [_SimReq(a, k) for a, k in zip(wl.arrivals, wl.tokens)]
    rooms = wl.rooms
    n = len(reqs)
    i = 0
    k_snap = k_samp = 0
    sample_period = ns.sample_ms / 1000.0
    req_ratios: list[float] = []
    tok_ratios: list[float] = []
    totals: list[int] = []
    samples_total = 0
    inf = float("inf")
    end = wl.duration
    while True:
        t_step = events[0][0] if events else inf
        t_arr = reqs[i].arrival if i < n else inf
        t_snap = k_snap * SNAPSHOT_PERIOD_S
        t_snap = t_snap if t_snap <= end and not live_board else inf
        t_samp = k_samp * sample_period
        t_samp = t_samp if t_samp <= end else inf
        t = min(t_step, t_arr, t_snap, t_samp)
        if t == inf:
            break
        if t == t_step:
            _, _, idx = heapq.heappop(events)
            end_step(ranks[idx], t)
        elif t == t_arr:
            req = reqs[i]
            clock_now[0] = t
            slot = disp.dispatch(DispatchItem(req.tokens, None, rooms[i]))
            rank = ranks[slot]
            rank.inbox.append(req)
            rank.out_reqs += 1
            rank.out_tokens += req.tokens
            if not rank.busy:
                start_step(rank, t)
            i += 1
        elif t == t_snap:
            for r in ranks:
                board[r.idx] = r.snapshot(t)
            k_snap += 1
        else:
            samples_total += 1
            total_reqs = sum(r.out_reqs for r in ranks)
            if total_reqs >= NUM_RANKS:
                totals.append(total_reqs)
                req_ratios.append(max(r.out_reqs for r in ranks) * NUM_RANKS / total_reqs)
                total_tok = sum(r.out_tokens for r in ranks)
                tok_ratios.append(max(r.out_tokens for r in ranks) * NUM_RANKS / total_tok)
            k_samp += 1

    return SimRaw(
        req_ratios, tok_ratios, totals, samples_total,
        [(r.done - r.arrival) * 1000 for r in reqs],
        [(r.done - r.arrival) * 1000 for r in reqs if r.tokens <= 200],
    )


def _ratio_summary(vals: list[float], totals: list[int]) -> tuple[float, float, float, float]:
    if not vals:
        return (float("nan"),) * 4
    busy = [v for v, n in zip(vals, totals) if n >= BUSY_PER_RANK * NUM_RANKS]
    return (statistics.fmean(vals), sum(1 for v in vals if v >= 2.0) / len(vals), max(vals),
            max(busy) if busy else float("nan"))


def balance_row(label: str, method: str, refresh_interval: float, live_board: bool,
                runs: list[SimRaw]) -> BalanceRow:
    """Samples and requests of every seed pooled."""
    req = [v for r in runs for v in r.req_ratios]
    tok = [v for r in runs for v in r.tok_ratios]
    totals = [n for r in runs for n in r.totals]
    lat = [v for r in runs for v in r.completion_ms]
    short = [v for r in runs for v in r.short_ms]
    refresh = "every request" if refresh_interval == 0 else f"{refresh_interval * 1000:g} ms"
    return BalanceRow(
        label=label, method=method, refresh=refresh if method in LOAD_AWARE else "-",
        board="republished on every read" if live_board else
        f"snapshot every {SNAPSHOT_PERIOD_S * 1000:g} ms",
        req_ratio=_ratio_summary(req, totals), tok_ratio=_ratio_summary(tok, totals),
        samples=len(req), samples_total=sum(r.samples_total for r in runs),
        completion_ms=(percentile(lat, 50), percentile(lat, 99)),
        short_p99_ms=percentile(short, 99),
    )


def balance_variants() -> list[tuple[str, str, float, bool]]:
    """(label, method, refresh interval, live board)"""
    rows = [(m, m, REFRESH_INTERVAL_S, False) for m in METHODS]
    rows += [
        ("total_requests, refresh every request", "total_requests", 0.0, False),
        ("total_tokens, refresh every request", "total_tokens", 0.0, False),
        ("total_requests, live board, refresh every request", "total_requests", 0.0, True),
        ("total_requests, live board, 20 ms throttle", "total_requests", REFRESH_INTERVAL_S,
         True),
    ]
    return rows


def run_balance(ns: argparse.Namespace, log) -> tuple[list[Workload], list[BalanceRow]]:
    workloads = [make_workload(ns, ns.seed + k) for k in range(ns.seeds)]
    rows = []
    for label, method, interval, live in balance_variants():
        runs = [simulate(wl, method, interval, ns, live_board=live) for wl in workloads]
        rows.append(balance_row(label, method, interval, live, runs))
    log(f"balance: {sum(len(w.arrivals) for w in workloads)} requests x {len(rows)} variants")
    return workloads, rows


# --------------------------------------------------------------------------------- output


def code_version() -> str:
    """The commit measured, and whether the controller's code differs from it."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "common"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    return f"{head or 'n/a'}{' + uncommitted common/ changes' if dirty else ''}"


def header(load_before: str) -> str:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return "\n".join([
        "| date | commit | python | pyzmq (libzmq) | msgspec | CPU | load avg 1/5/15 min "
        "(before; after) |",
        "|---|---|---|---|---|---|---|",
        f"| {now} | {code_version()} | {platform.python_version()} | {zmq.__version__} "
        f"({zmq.zmq_version()}) | {msgspec.__version__} | {cpu_model()}, {os.cpu_count()} "
        f"logical cores | {load_before}; {load_average()} |",
        "",
        "torch is not needed (not imported).",
    ])


def verdict(r: MethodResult, ok: bool) -> str:
    return "-" if r.reports_ok is None else "met" if ok else "missed"


def format_throughput(results: list[MethodResult], ns: argparse.Namespace) -> str:
    long = ""
    if ns.long_prompt_tokens:
        long = f", {ns.long_requests:,} with {ns.long_prompt_tokens}"
    out = [
        f"### Controller throughput ({ns.requests:,} requests per run with "
        f"{ns.prompt_tokens}-token prompts{long}; best / median of {ns.repeats}; "
        f"target >= {TARGET_DISPATCH_PER_S:,}/s)",
        "",
        "| method | prompt tokens | dispatches/s best | dispatches/s median | front end send/s | "
        "process CPU us/dispatch | process CPU use (incl. zmq I/O thread) | per-rank share | "
        "reports | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    rows = [(r, r.throughput, ns.prompt_tokens) for r in results]
    rows += [(r, r.long_throughput, ns.long_prompt_tokens) for r in results if r.long_throughput]
    for r, tp, tokens in rows:
        total = sum(tp.per_rank) or 1
        share = "/".join(f"{c * 100 / total:.0f}" for c in tp.per_rank)
        med_s = statistics.median(tp.seconds)
        cpu_use = statistics.median(tp.ctrl_cpu_us) * 1e-6 * tp.n / med_s
        out.append(
            f"| {r.method} | {tokens} | {tp.best:,.0f} | {tp.median:,.0f} | "
            f"{tp.n / statistics.median(tp.send_seconds):,.0f} | "
            f"{statistics.median(tp.ctrl_cpu_us):.1f} | {cpu_use * 100:.0f} % | {share} % | "
            f"{'-' if r.reports_ok is None else 'complete' if r.reports_ok else 'MISSING'} | "
            f"{verdict(r, tp.best >= TARGET_DISPATCH_PER_S)} |"
        )
    out += [
        "",
        "Dispatches/s = requests / (first send -> last arrival at a scheduler socket). The front "
        "end sends pre-encoded requests; when the controller's input is full (a ZMQ PUSH's "
        "1,000-message high-water mark, a stream socket's buffer) it waits, so its send rate "
        "follows the controller's. Process CPU: all its threads, from "
        "/proc/PID/task/*/schedstat. "
        "Controllers get what `FrontEnd(via_controller=True)` sends ([routing header, request] "
        "frames, `scheduler_input.controller_frames`) on their Unix stream socket "
        "(`frame_stream`); a `METHOD @ COMMIT` row is the controller of that commit "
        "(`--reference`), fed the way that commit's front end fed it (ZMQ before the stream "
        "socket, single frames before the header frame). Baselines: Python processes wired like "
        "the controller that do only part of its work (round robin, no Dispatcher, no reports): "
        "a ZMQ PULL -> PUSH `recv()` -> `send()` of single-frame requests (the floor of any "
        "Python forwarder behind ZMQ); [header, request] frames on a ZMQ PULL, the header "
        "decoded, the request frame forwarded zero-copy (the previous controller's transport); "
        "the same frames read from a Unix stream socket in a blocking recv (the controller's "
        "transport: the controller minus Dispatcher and reports).",
    ]
    return "\n".join(out)


def format_latency(results: list[MethodResult], ns: argparse.Namespace) -> str:
    out = [
        f"### Per-hop latency ({ns.latency_samples:,} requests one at a time, send -> arrival at a "
        f"scheduler socket, us; target: added p50 < {TARGET_ADDED_P50_US:g} us)",
        "",
        "| method | via controller p50 | p90 | p99 | direct PUSH->PULL p50 | p90 | p99 | "
        "added p50 | added p90 | added p99 | added p50 / direct p50 | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        via = [percentile(r.latency.via_us, q) for q in (50, 90, 99)]
        direct = [percentile(r.latency.direct_us, q) for q in (50, 90, 99)]
        added = [v - d for v, d in zip(via, direct)]
        cells = " | ".join(f"{x:.1f}" for x in (*via, *direct, *added))
        out.append(f"| {r.method} | {cells} | {added[0] / direct[0]:.2f} | "
                   f"{verdict(r, added[0] < TARGET_ADDED_P50_US)} |")
    out += [
        "",
        "Each sample through the controller (front end -> controller -> scheduler socket: two "
        "hops) is paired with one direct PUSH -> PULL sample (one hop), alternating which goes "
        f"first, each after {ns.latency_gap_us:g} us of quiet (every process asleep when a request "
        f"arrives), in blocks of {latency_block(ns)} requests per row, the rows taking turns; "
        "\"added\" = the "
        "controller's cost: one more hop plus its processing; \"added / direct\" puts it in "
        "units of the machine's own hop cost, which varies from run to run on a shared VM. The "
        "baseline rows split that cost: a bare ZMQ relay (the extra hop alone, as any ZMQ "
        "forwarder pays it), the previous controller's ZMQ input with the header decode, and "
        "the controller's own stream-socket input with the header decode (the controller minus "
        "the Dispatcher and its reports: one DispatchReport per 10 ms, here one per few "
        "requests).",
    ]
    return "\n".join(out)


def format_profile(p: ProfileResult) -> str:
    out = [
        "### In-process ControllerLoop (real run_forever on pre-queued requests; no other process "
        "of the benchmark running; best of the repeats, methods interleaved)",
        "",
        f"| method | thread CPU us/dispatch | wall us/dispatch | ceiling dispatches/s | "
        f"{p.long_tokens}-token prompts: thread CPU us | wall us | ceiling/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        out.append(f"| {m} | {p.thread_cpu_us[m]:.1f} | {p.wall_us[m]:.1f} | "
                   f"{1e6 / p.wall_us[m]:,.0f} | {p.long_cpu_us[m]:.1f} | "
                   f"{p.long_wall_us[m]:.1f} | {1e6 / p.long_wall_us[m]:,.0f} |")
    out += [
        "",
        f"#### cProfile of run_forever, {p.method}, {p.n:,} dispatches (profiler overhead "
        "inflates Python-level calls)",
        "",
        "| function | own us/dispatch | cumulative us/dispatch | calls |",
        "|---|---:|---:|---:|",
    ]
    for name, tt, ct, calls in p.top:
        out.append(f"| `{name}` | {tt:.2f} | {ct:.2f} | {calls:,} |")
    out += [
        "",
        "#### Cost of each step alone (us per request, no profiler, best of 3)",
        "",
        "| step | us | note |",
        "|---|---:|---|",
    ]
    for name, us, note in p.components:
        out.append(f"| {name} | {us:.2f} | {note} |")
    return "\n".join(out)


def format_balance(workloads: list[Workload], rows: list[BalanceRow],
                   ns: argparse.Namespace) -> str:
    tokens = [k for wl in workloads for k in wl.tokens]
    n_long = sum(1 for k in tokens if k >= 2000)
    wl = workloads[0]
    seeds = ", ".join(str(ns.seed + k) for k in range(len(workloads)))
    out = [
        f"### Balance quality ({len(workloads)} x {wl.duration:g} s simulated, "
        f"{len(tokens):,} requests, {wl.rate:.0f} req/s = {ns.utilization * 100:.0f} % of "
        f"{NUM_RANKS} ranks x {ns.rank_tokens_per_s:,} tok/s; seeds {seeds})",
        "",
        f"Workload: {100 - n_long * 100 / len(tokens):.0f} % 50-200 tokens, "
        f"{n_long * 100 / len(tokens):.0f} % 2,000-8,000 tokens (mean {wl.mean_tokens:.0f}); "
        f"{(1 - ns.burst_fraction) * 100:.0f} % Poisson background, "
        f"{ns.burst_fraction * 100:.0f} % in Poisson bursts of {ns.burst_min}-{ns.burst_max} "
        f"requests {ns.burst_gap_s * 1e3:g} ms apart on average. Ranks: FIFO steps of <= "
        f"{ns.chunk} tokens, socket read between steps; board snapshots every "
        f"{SNAPSHOT_PERIOD_S * 1e3:g} ms (\"republished on every read\": a board that is always "
        "fresh but still shows each rank's own, lagging view). Ratio = max/mean across ranks of "
        f"outstanding requests (tokens), sampled every {ns.sample_ms:g} ms while >= 1 request per "
        "rank is outstanding on average; 1.00 = even, 4.00 = all on one rank. \">= 2\": share of "
        "samples where one rank holds at least twice the mean; \"worst busy\": worst sample with "
        f">= {BUSY_PER_RANK} outstanding requests per rank on average. Completion: arrival -> "
        "last token "
        "computed; short = <= 200 tokens.",
        "",
        "| method | refresh | board | req ratio mean | >= 2 | worst | worst busy | token ratio "
        "mean | >= 2 | worst | worst busy | completion p50 ms | p99 ms | short p99 ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rm, r2, rx, rb = r.req_ratio
        tm, t2, tx, tb = r.tok_ratio
        out.append(
            f"| {r.method} | {r.refresh} | {r.board} | {rm:.2f} | {r2 * 100:.0f} % | {rx:.2f} | "
            f"{rb:.2f} | {tm:.2f} | {t2 * 100:.0f} % | {tx:.2f} | {tb:.2f} | "
            f"{r.completion_ms[0]:.0f} | {r.completion_ms[1]:.0f} | {r.short_p99_ms:.0f} |"
        )
    samples = rows[0].samples_total if rows else 0
    out += ["", f"{samples:,} samples per row; rows with >= 1 outstanding request per rank: "
            + ", ".join(f"{r.samples * 100 / max(1, r.samples_total):.0f} %" for r in rows)
            + " (in row order)."]
    return "\n".join(out)


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds: small counts")
    p.add_argument("--requests", type=int, default=20_000, help="per throughput run")
    p.add_argument("--repeats", type=int, default=5,
                   help="throughput and in-process runs per method (best and median shown)")
    p.add_argument("--warmup", type=int, default=1_000)
    p.add_argument("--latency-samples", type=int, default=3_000)
    p.add_argument("--latency-gap-us", type=float, default=300.0,
                   help="quiet time before each latency sample")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--long-prompt-tokens", type=int, default=2048,
                   help="a second throughput run with long prompts (0: skip)")
    p.add_argument("--long-requests", type=int, default=5_000)
    p.add_argument("--profile-requests", type=int, default=20_000,
                   help="per in-process run (0: skip the in-process profile)")
    p.add_argument("--profile-method", default="total_tokens", choices=METHODS)
    p.add_argument("--reference", metavar="GITREF",
                   help="also run the controller of this commit (e.g. HEAD): before/after")
    p.add_argument("--skip-controller", action="store_true", help="balance simulation only")
    p.add_argument("--skip-balance", action="store_true", help="controller benchmark only")
    p.add_argument("--seed", type=int, default=0, help="first workload seed")
    p.add_argument("--seeds", type=int, default=3, help="workloads replayed (seed, seed+1, ..)")
    p.add_argument("--sim-seconds", type=float, default=120.0)
    p.add_argument("--utilization", type=float, default=0.8,
                   help="offered tokens / total rank capacity")
    p.add_argument("--rank-tokens-per-s", type=int, default=40_000)
    p.add_argument("--chunk", type=int, default=2048, help="tokens per rank step")
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--burst-fraction", type=float, default=0.4,
                   help="share of requests that arrive in bursts")
    p.add_argument("--burst-min", type=int, default=16)
    p.add_argument("--burst-max", type=int, default=64)
    p.add_argument("--burst-gap-s", type=float, default=1e-4,
                   help="mean gap between the requests of a burst")
    p.add_argument("--sample-ms", type=float, default=1.0)
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.repeats, ns.warmup = 1_000, 2, 100
        ns.latency_samples, ns.profile_requests, ns.sim_seconds = 100, 1_000, 8.0
        ns.seeds, ns.long_requests = 1, 200
    return ns


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    load_before = load_average()
    rng = random.Random(ns.seed)
    results: list[MethodResult] = []
    prof = None
    balance = None
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-") as tmp:
        if not ns.skip_controller:
            reference = extract_reference(ns.reference, tmp) if ns.reference else None
            rig = Rig(tmp)
            try:
                results = bench_controllers(rig, ns, rng, log, reference)
            finally:
                rig.close()
            if ns.profile_requests > 0:
                prof = profile_controller(ns, tmp, rng, log)
    if not ns.skip_balance:
        balance = run_balance(ns, log)

    print("## bench_dispatch: DP controller dispatch throughput and balance")
    print()
    print(header(load_before))
    print()
    if results:
        print(format_throughput(results, ns))
        print()
        print(format_latency(results, ns))
        print()
    if prof is not None:
        print(format_profile(prof))
        print()
    if balance is not None:
        print(format_balance(*balance, ns))
        print()
    print(f"total {time.perf_counter() - start:.0f} s")
    return {"controller": results, "profile": prof, "balance": balance}


if __name__ == "__main__":
    main()
