"""Time to first token of PD (prefill + decode services) versus colocated, at low load.

    python benchmarks/bench_pd_ttft.py [--prompt-lens 16,256,1024] [--repeats 10]
                                       [--backends tcp,torch] [--new-tokens 4] [--quick]
    python benchmarks/bench_pd_ttft.py --quick        # tiny 2-layer model, tcp, ~35 s

One request at a time (no batching, no queueing): what PD adds to the first token when the
machine is otherwise idle, i.e. the handshake and the KV transfer. Two parts in one run:

1. End to end, real processes. A colocated `pdserve serve`, and per backend a `pdserve prefill`
   + `pdserve decode` pair (dp 1 each, `--torch-num-threads 1`, the same model and page size).
   TTFT = time from sending a streaming `/generate` request to its first SSE `data:` chunk
   (the first token; a new HTTP connection per request, the client in this process). For PD
   the same body plus the bootstrap fields goes to prefill and to decode concurrently, as the
   router sends it, and the TTFT is decode's first chunk. Colocated and PD requests alternate
   (one of each per repetition, same random prompt), so "PD - colocated" is the median of the
   paired differences, which drifting machine load disturbs least. One untimed warm-up per
   prompt length and path first (it also builds the transfer link and fetches the prefill
   topology).

2. Phase split, in process. The real engines, the real transfer backend over loopback and the
   real PD queues, each side driven by its own thread that loops like `SchedulerLoop` (tick the
   queues, step the engine when it has work, otherwise wait up to PD_POLL_MS = 1 ms for a
   message while waiting on a peer); the control channel is a queue between the threads. The
   benchmark wraps methods of these objects (nothing in the production code changes) to stamp:

       arrival         the request is handed to both sides' loops
       bootstrap       arrival -> decode has preallocated pages and sent the KVRequest
       control hop     KVRequest sent -> prefill meets it (engine.add of the request)
       prefill fwd     met -> first token sampled (`on_prefilled`)
       transfer        sender.send called -> the receiver holds every byte (its state: Success)
       notice          -> decode's loop sees Success (its 1 ms poll)
       adopt           -> the first token's delta leaves `DecodeQueues.tick` (`EngineCore.adopt`)
       total           arrival -> that delta; colocated: arrival -> the engine's first delta
       added           total - prefill fwd: what PD adds to the same forward pass (the median
                       of the per-request sums; the forward itself is the noisy part)

   The colocated row is the same loop around a plain engine. The HTTP front end, tokenizer
   and detokenizer processes are not in this part (they are in part 1, on both paths).

All figures are milliseconds, median (p50) and p90 over --repeats; the machine this was written
on is shared with other jobs, so medians and paired differences are the figures to read.
`main(argv)` returns the rows (tests run `--quick`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "tests"):  # `common`, `server_utils`, `tiny_models`
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from common.config import ServerArgs  # noqa: E402
from common.engine.engine import EngineCore  # noqa: E402
from common.engine.loader import load_engine_parts  # noqa: E402
from common.engine.tokenizer import Tokenizer  # noqa: E402
from common.messages.kv_bootstrap import KVAbort, KVRequest, KVStatus  # noqa: E402
from common.messages.kv_bootstrap import PrefillTopology, RankRegistration  # noqa: E402
from common.messages.sampling import SamplingParams  # noqa: E402
from common.messages.scheduler_input import GenerateRequest  # noqa: E402
from common.server.scheduler_process import PD_POLL_MS  # noqa: E402
from common.transfer.base import KVPoll  # noqa: E402
from common.transfer.registry import make_receiver, make_sender  # noqa: E402
from common.transfer.tcp import pool_layout  # noqa: E402
from decode.prefill_directory import PeerEntry, PeerState  # noqa: E402
from decode.queues import DecodeQueues  # noqa: E402
from prefill.queues import PrefillQueues  # noqa: E402

clock = time.perf_counter
PHASES = ("bootstrap", "control hop", "prefill fwd", "transfer", "notice", "adopt")


def ms(seconds: float) -> float:
    return seconds * 1e3


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0..2 are specials in tiny


# ============================================================== part 1: real processes
def start_services(servers) -> None:
    """Start every ServerProcess at once (each start waits for /health): the start-up of the
    model loads overlaps, which matters on 2 cores."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.stop()
        raise next(e for e in errors if e is not None)


def stream_times(port: int, body: bytes, t0: float) -> tuple[float, float]:
    """POST a streaming /generate; (first data chunk, [DONE]) in seconds after t0."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/generate", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from :{port}: {resp.read()[:500]!r}")
        first = None
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError(f"the stream from :{port} ended without [DONE]")
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                return first, clock() - t0
            if first is None:
                first = clock() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"error from :{port}: {chunk['error']}")
    finally:
        conn.close()


def colocated_ttft(server, body: dict) -> float:
    t0 = clock()
    return stream_times(server.port, json.dumps(body).encode(), t0)[0]


def pd_ttft(prefill, decode, bootstrap_port: int, body: dict) -> tuple[float, float]:
    """(decode's first chunk, prefill's first chunk) after sending both at once."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    raw = json.dumps(body).encode()
    result: dict = {}

    def run_prefill():
        try:
            result["prefill"] = stream_times(prefill.port, raw, t0)[0]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result["error"] = exc

    t0 = clock()
    thread = threading.Thread(target=run_prefill)
    thread.start()
    try:
        first = stream_times(decode.port, raw, t0)[0]
    finally:
        thread.join(300)
    if "error" in result:
        raise result["error"]
    return first, result["prefill"]


@dataclass
class E2ERow:
    prompt_len: int
    path: str  # "colocated" or "PD <backend>"
    ttft_s: list[float]
    diff_s: list[float] = field(default_factory=list)  # paired PD - colocated
    prefill_answer_s: list[float] = field(default_factory=list)  # PD: prefill's first chunk


def end_to_end(model_dir: Path, args, vocab: int, log) -> list[E2ERow]:
    from server_utils import ServerProcess, free_port

    common = ("--torch-num-threads", "1", "--max-total-tokens", str(args.max_total_tokens),
              "--page-size", str(args.page_size), "--dp-size", "1", "--log-level", "warning")
    rng = random.Random(0)
    colocated = ServerProcess(model_dir, *common)
    coloc: dict[int, list[float]] = {n: [] for n in args.lens}
    rows: list[E2ERow] = []
    first_block = True
    try:
        for backend in args.backends:
            bootstrap_port = free_port()
            pd_args = (*common, "--disaggregation-transfer-backend", backend)
            prefill = ServerProcess(model_dir, *pd_args, "--disaggregation-bootstrap-port",
                                    str(bootstrap_port), command="prefill")
            decode = ServerProcess(model_dir, *pd_args, command="decode")
            t = clock()
            start_services([prefill, decode] + ([colocated] if first_block else []))
            first_block = False
            log(f"  started {'colocated + ' if len(rows) == 0 else ''}PD {backend} services "
                f"in {clock() - t:.1f} s")
            try:
                for n in args.lens:
                    body = {"sampling_params": {"max_new_tokens": args.new_tokens,
                                                "temperature": 0, "ignore_eos": True},
                            "stream": True}
                    warm = {**body, "input_ids": random_prompt(rng, n, vocab)}
                    colocated_ttft(colocated, warm)
                    pd_ttft(prefill, decode, bootstrap_port, warm)
                    row = E2ERow(n, f"PD {backend}", [])
                    for i in range(args.repeats):
                        req = {**body, "input_ids": random_prompt(rng, n, vocab)}
                        if i % 2:  # alternate which path goes first
                            d, p = pd_ttft(prefill, decode, bootstrap_port, req)
                            c = colocated_ttft(colocated, req)
                        else:
                            c = colocated_ttft(colocated, req)
                            d, p = pd_ttft(prefill, decode, bootstrap_port, req)
                        coloc[n].append(c)
                        row.ttft_s.append(d)
                        row.prefill_answer_s.append(p)
                        row.diff_s.append(d - c)
                    rows.append(row)
                    log(f"  {backend} {n:5d} tokens: colocated p50 "
                        f"{ms(pct(coloc[n][-args.repeats:], .5)):.1f} ms, PD p50 "
                        f"{ms(pct(row.ttft_s, .5)):.1f} ms")
            finally:
                decode.stop()
                prefill.stop()
    finally:
        colocated.stop()
    out = []
    for n in args.lens:
        out.append(E2ERow(n, "colocated", coloc[n]))
        out += [r for r in rows if r.prompt_len == n]
    return out


# ============================================================== part 2: phases in process
class StaticDirectory:
    """The prefill directory, always READY with a fixed topology (no HTTP)."""

    def __init__(self, topology: PrefillTopology):
        self.entry = PeerEntry("127.0.0.1", 8998, PeerState.READY, topology)

    def lookup(self, host: str, port: int) -> PeerEntry:
        return self.entry


class Loop(threading.Thread):
    """One side's scheduler loop, as `SchedulerLoop.run_forever` runs it: messages, then
    `tick()` of the PD queues, then one engine step if there is work; otherwise wait for a
    message up to 1 ms while waiting on a peer (PD_POLL_MS), else up to 50 ms."""

    def __init__(self, name: str, engine: EngineCore, queues, emit):
        super().__init__(name=name, daemon=True)
        self.engine, self.queues, self.emit = engine, queues, emit
        self.front = queues if queues is not None else engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped:
                busy = self.engine.has_work()
                waiting = self.queues is not None and self.queues.waiting_on_io()
                msgs = []
                try:
                    if busy:
                        msgs.append(self.inbox.get_nowait())
                    else:
                        msgs.append(self.inbox.get(timeout=PD_POLL_MS / 1e3 if waiting
                                                   else 0.05))
                except queue.Empty:
                    pass
                while True:
                    try:
                        msgs.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for msg in msgs:
                    self.handle(msg)
                if self.queues is not None:
                    self.emit(self.queues.tick())
                if self.engine.has_work():
                    self.emit(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self.emit(self.front.add(msg))
        elif isinstance(msg, KVRequest):
            self.emit(self.queues.on_kv_request(msg))
        elif isinstance(msg, KVAbort):
            self.emit(self.queues.on_kv_abort(msg))
        elif isinstance(msg, KVStatus):
            self.emit(self.queues.on_status(msg))


class Stamps:
    """First time each named event happened for the request in flight (one at a time)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.done = threading.Event()
        self.finished = threading.Event()

    def reset(self) -> None:
        self.t = {}
        self.done.clear()
        self.finished.clear()

    def mark(self, name: str) -> None:
        self.t.setdefault(name, clock())


def _stamp_success(state, stamps: Stamps, name: str):
    """Wrap one TransferState's advance so that reaching Success is stamped."""
    advance = state.advance

    def wrapped(new):
        advance(new)
        if state.state is KVPoll.Success:
            stamps.mark(name)

    state.advance = wrapped
    if state.state is KVPoll.Success:
        stamps.mark(name)
    return state


class PhaseBench:
    def __init__(self, model_dir: Path, backend: str, page_size: int, max_total_tokens: int):
        def engine() -> EngineCore:
            args = ServerArgs(model_path=str(model_dir), device="cpu", page_size=page_size,
                              max_total_tokens=max_total_tokens)
            return EngineCore(args, load_engine_parts(args, str(model_dir)),
                              Tokenizer.from_model_path(model_dir))

        self.backend = backend
        self.stamps = Stamps()
        s = self.stamps
        self.colocated, self.prefill, self.decode = engine(), engine(), engine()
        self.sender = make_sender(backend, self.prefill.pool, 60.0)
        self.receiver = make_receiver(backend, self.decode.pool, "127.0.0.1", 60.0)
        self.p = PrefillQueues(self.prefill, self.sender, self._prefill_sends, 1)
        layout = pool_layout(self.prefill.pool)
        reg = RankRegistration(dp_rank=0, control_endpoint="prefill-rank-0",
                               num_layers=layout.num_layers, page_size=layout.page_size,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               dtype=layout.dtype, transfer_backend=backend)
        directory = StaticDirectory(PrefillTopology(num_dp_slots=1, transfer_backend=backend,
                                                    ranks={0: reg}))
        self.d = DecodeQueues(self.decode, self.receiver, directory, self._decode_sends,
                              "decode-rank-0")
        self.bytes_per_token = (layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim
                                * self.prefill.pool.k.element_size())

        # ---- stamps: wrappers on these instances only ----
        add = self.prefill.add
        self.prefill.add = lambda msg: (s.mark("met"), add(msg))[1]
        on_prefilled = self.prefill.on_prefilled  # PrefillQueues._on_prefilled

        def prefilled(*a):
            s.mark("sampled")
            on_prefilled(*a)
        self.prefill.on_prefilled = prefilled
        send = self.sender.send
        self.sender.send = lambda *a, **k: (s.mark("send"),
                                            _stamp_success(send(*a, **k), s, "sent"))[1]
        expect = self.receiver.expect
        self.receiver.expect = lambda room, pages: _stamp_success(expect(room, pages), s,
                                                                  "bytes_in")
        adopt = self.d._adopt
        self.d._adopt = lambda entry: (s.mark("adopt"), adopt(entry))[1]

        self.loops = {
            "colocated": Loop("colocated", self.colocated, None, self._emit_colocated),
            "prefill": Loop("prefill", self.prefill, self.p, self._emit_prefill),
            "decode": Loop("decode", self.decode, self.d, self._emit_decode),
        }
        for loop in self.loops.values():
            loop.start()

    # ---- control channel and outputs ----
    def _prefill_sends(self, endpoint: str, msg) -> bool:
        self.loops["decode"].inbox.put(msg)
        return True

    def _decode_sends(self, endpoint: str, msg) -> bool:
        if isinstance(msg, KVRequest):
            self.stamps.mark("kv_request")
        self.loops["prefill"].inbox.put(msg)
        return True

    def _check(self, deltas) -> None:
        for d in deltas:
            if d.finish_reason is not None and d.finish_reason.type == "abort":
                self.stamps.t["error"] = d.finish_reason.message
                self.stamps.done.set()
                self.stamps.finished.set()

    def _emit_colocated(self, deltas) -> None:
        self._first(deltas)

    def _emit_decode(self, deltas) -> None:
        self._first(deltas)

    def _emit_prefill(self, deltas) -> None:
        self._check(deltas)
        if any(d.finished for d in deltas):
            self.stamps.mark("prefill_released")
            self._maybe_finished()

    def _first(self, deltas) -> None:
        self._check(deltas)
        for d in deltas:
            if d.new_ids and "first" not in self.stamps.t:
                self.stamps.mark("first")
                self.stamps.done.set()
            if d.finished:
                self.stamps.mark("finished")
                self._maybe_finished()

    def _maybe_finished(self) -> None:
        t = self.stamps.t
        if "finished" in t and ("send" not in t or "prefill_released" in t):
            self.stamps.finished.set()

    # ---- one request ----
    def run_one(self, path: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
        msg = GenerateRequest(
            rid=f"r{random.getrandbits(32)}", input_ids=prompt,
            sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0,
                                    ignore_eos=True),
            stream=True, bootstrap_room=random.getrandbits(63), bootstrap_host="127.0.0.1",
            bootstrap_port=8998)
        self.stamps.reset()
        targets = ([self.loops["colocated"]] if path == "colocated"
                   else [self.loops["prefill"], self.loops["decode"]])
        self.stamps.mark("arrival")
        for loop in targets:
            loop.inbox.put(msg)
        if not self.stamps.finished.wait(300):
            raise RuntimeError(f"{path}: the request did not finish: {self.stamps.t}")
        for loop in self.loops.values():
            if loop.error is not None:
                raise RuntimeError(f"the {loop.name} loop died") from loop.error
        if "error" in self.stamps.t:
            raise RuntimeError(f"{path}: {self.stamps.t['error']}")
        t = self.stamps.t
        out = {"total": t["first"] - t["arrival"]}
        if path != "colocated":
            out.update({
                "bootstrap": t["kv_request"] - t["arrival"],
                "control hop": t["met"] - t["kv_request"],
                "prefill fwd": t["sampled"] - t["met"],
                "transfer": t["bytes_in"] - t["send"],
                "notice": t["adopt"] - t["bytes_in"],
                "adopt": t["first"] - t["adopt"],
            })
            out["added"] = out["total"] - out["prefill fwd"]  # everything PD adds
        # let the pools settle (decode's pages are freed at its finish, prefill's at release)
        deadline = clock() + 10
        while clock() < deadline and (self.d.waiting_on_io() or self.p.waiting_on_io()
                                      or self.prefill.has_work() or self.decode.has_work()):
            time.sleep(0.001)
        return out

    def close(self) -> None:
        for loop in self.loops.values():
            loop.stopped = True
        for loop in self.loops.values():
            loop.join(5)
        self.sender.close()
        self.receiver.close()


@dataclass
class PhaseRow:
    prompt_len: int
    path: str
    kv_mib: float
    samples: list[dict[str, float]]

    def p50(self, key: str) -> float:
        return pct([s[key] for s in self.samples], .5)

    def p90(self, key: str) -> float:
        return pct([s[key] for s in self.samples], .9)


def phase_split(model_dir: Path, args, vocab: int, log) -> list[PhaseRow]:
    rng = random.Random(1)
    rows: list[PhaseRow] = []
    coloc: dict[int, PhaseRow] = {}
    for backend in args.phase_backends:
        bench = PhaseBench(model_dir, backend, args.page_size, args.max_total_tokens)
        try:
            for n in args.lens:
                kv = bench.decode.pool.pages_for(n) * args.page_size * bench.bytes_per_token
                warm = random_prompt(rng, n, vocab)
                bench.run_one("colocated", warm, args.new_tokens)
                bench.run_one("pd", warm, args.new_tokens)
                row = PhaseRow(n, f"PD {backend}", kv / 2**20, [])
                c_row = coloc.setdefault(n, PhaseRow(n, "colocated", 0.0, []))
                for i in range(args.repeats):
                    prompt = random_prompt(rng, n, vocab)
                    order = ("pd", "colocated") if i % 2 else ("colocated", "pd")
                    for path in order:
                        (row if path == "pd" else c_row).samples.append(
                            bench.run_one(path, prompt, args.new_tokens))
                rows.append(row)
                log(f"  in process {backend} {n:5d} tokens: colocated p50 "
                    f"{ms(c_row.p50('total')):.1f} ms, PD p50 {ms(row.p50('total')):.1f} ms")
        finally:
            bench.close()
    out = []
    for n in args.lens:
        out.append(coloc[n])
        out += [r for r in rows if r.prompt_len == n]
    return out


# ============================================================== output
def print_e2e(rows: list[E2ERow], repeats: int) -> None:
    print(f"## End to end: streaming /generate -> first SSE chunk (ms; {repeats} requests per "
          "row, one at a time)\n")
    print("| prompt tokens | path | TTFT p50 | TTFT p90 | TTFT min | PD - colocated p50 "
          "(paired) | PD - colocated p90 (paired) | prefill answered p50 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [str(r.prompt_len), r.path, f"{ms(pct(r.ttft_s, .5)):.1f}",
                 f"{ms(pct(r.ttft_s, .9)):.1f}", f"{ms(min(r.ttft_s)):.1f}"]
        if r.diff_s:
            cells += [f"{ms(pct(r.diff_s, .5)):+.1f}", f"{ms(pct(r.diff_s, .9)):+.1f}",
                      f"{ms(pct(r.prefill_answer_s, .5)):.1f}"]
        else:
            cells += ["-", "-", "-"]
        print("| " + " | ".join(cells) + " |")
    print()


def print_phases(rows: list[PhaseRow], repeats: int) -> None:
    print(f"## In process, split by phase (ms, p50 of {repeats}; total also p90)\n")
    print("| prompt tokens | path | KV MiB | total p50 | total p90 | "
          + " | ".join(PHASES) + " | added (all but prefill fwd) p50 | PD - colocated p50 |")
    print("|---:|---|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|")
    coloc = {r.prompt_len: r for r in rows if r.path == "colocated"}
    for r in rows:
        cells = [str(r.prompt_len), r.path, f"{r.kv_mib:.2f}" if r.kv_mib else "-",
                 f"{ms(r.p50('total')):.2f}", f"{ms(r.p90('total')):.2f}"]
        if r.path == "colocated":
            cells += ["-", "-", f"{ms(r.p50('total')):.2f}"] + ["-"] * (len(PHASES) - 3)
            cells += ["-", "-"]
        else:
            cells += [f"{ms(r.p50(p)):.2f}" for p in PHASES]
            cells.append(f"{ms(r.p50('added')):.2f}")
            cells.append(f"{ms(r.p50('total') - coloc[r.prompt_len].p50('total')):+.2f}")
        print("| " + " | ".join(cells) + " |")
    print()


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None,
                        help="model folder (default: the embedded SmolLM2-135M-Instruct; "
                             "--quick: a tiny 2-layer Llama built in a temp folder)")
    parser.add_argument("--prompt-lens", default=None, help="default 16,256,1024 (--quick: 16,128)")
    parser.add_argument("--repeats", type=int, default=None, help="default 10 (--quick: 3)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--backends", default=None,
                        help="transfer backends of the end-to-end part (default tcp,torch; "
                             "--quick: tcp)")
    parser.add_argument("--phase-backends", default="tcp",
                        help="transfer backends of the in-process phase split")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (the services get 1)")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-phases", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, prompts 16 and 128, 3 repeats, tcp only")
    args = parser.parse_args(argv)
    quick = {"prompt_lens": "16,128", "repeats": 3, "backends": "tcp"}
    full = {"prompt_lens": "16,256,1024", "repeats": 10, "backends": "tcp,torch"}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lens = [int(x) for x in args.prompt_lens.split(",")]
    args.backends = [b for b in args.backends.split(",") if b]
    args.phase_backends = [b for b in args.phase_backends.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> dict[str, list]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    tmp = None
    if args.model_path:
        model_dir, name = Path(args.model_path), Path(args.model_path).name
    elif args.quick:
        from tiny_models import build_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="bench-pd-ttft-")
        model_dir, name = build_tiny_checkpoint(Path(tmp.name) / "tiny", "llama"), "tiny llama"
    else:
        from common.model_store.default_model import ensure_default_model

        model_dir, name = Path(ensure_default_model()), "SmolLM2-135M-Instruct"
    config = json.loads((model_dir / "config.json").read_text())
    vocab = min(config["vocab_size"], Tokenizer.from_model_path(model_dir).vocab_size)
    load = os.getloadavg()
    print(f"# bench_pd_ttft: PD vs colocated time to first token, one request at a time "
          f"({time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, torch {torch.__version__})")
    print(f"model {name}, page size {args.page_size}, {args.new_tokens} new tokens (greedy), "
          f"services dp 1 with --torch-num-threads 1, this process {args.threads} torch "
          f"thread(s); load average before {load[0]:.2f}\n")
    result: dict[str, list] = {"e2e": [], "phases": []}
    t = clock()
    try:
        if not args.skip_e2e:
            result["e2e"] = end_to_end(model_dir, args, vocab, log)
            print_e2e(result["e2e"], args.repeats)
        if not args.skip_phases:
            result["phases"] = phase_split(model_dir, args, vocab, log)
            print_phases(result["phases"], args.repeats)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"run time {clock() - t:.0f} s; load average after {os.getloadavg()[0]:.2f}")
    return result


if __name__ == "__main__":
    main()
