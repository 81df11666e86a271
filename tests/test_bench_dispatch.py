"""Smoke test of `benchmarks/bench_dispatch.py --quick`: the real controller process and the
balance simulator run end to end, and every table holds positive numbers.

The benchmark runs as a subprocess (it spawns a controller and a receiver process; keeping
them out of the pytest process avoids leaking sockets or children into other tests). The
simulator's determinism is checked in process on a short workload."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_dispatch.py"
METHODS = ("round_robin", "follow_bootstrap_room", "total_requests", "total_tokens")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_dispatch", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_dispatch", module)
    spec.loader.exec_module(module)
    return module


def _table(out: str, title: str) -> list[list[str]]:
    """The body rows (cells) of the markdown table that follows the heading `title`."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("#") and title in ln)
    rows, seen_header = [], False
    for ln in lines[start + 1:]:
        if ln.startswith("#"):
            break
        if not ln.startswith("|"):
            if seen_header and rows:
                break
            continue
        if not seen_header:
            seen_header = True
            continue
        if set(ln.replace("|", "").strip()) <= {"-", ":"}:
            continue
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _num(cell: str) -> float:
    return float(re.sub(r"[ ,%]", "", cell))


@pytest.mark.timeout(60)
def test_quick_benchmark_prints_positive_tables():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=55,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout

    header = _table(out, "bench_dispatch")
    assert header and re.match(r"\d{4}-\d\d-\d\d ", header[0][0])  # date, then the rest
    assert "CPU" in out and "torch is not needed" in out

    throughput = _table(out, "Controller throughput")
    rows = len(throughput) // 2  # the methods and the baselines, then again with long prompts
    names = [r[0] for r in throughput[:rows]]
    assert names[:4] == list(METHODS) and all(n.startswith("baseline") for n in names[4:])
    assert len(names) == 7  # 3 baselines: a ZMQ relay, the ZMQ input, the stream input
    assert [r[0] for r in throughput[rows:]] == names
    assert {r[1] for r in throughput[:rows]} == {"128"}
    assert {r[1] for r in throughput[rows:]} == {"2048"}
    for row in throughput:
        assert all(_num(c) > 0 for c in row[2:7]), row  # rates, CPU per dispatch, CPU use
        if row[0] in METHODS:
            assert row[8] == "complete", row  # every dispatch was reported to the front end
            assert row[9] in ("met", "missed")

    latency = _table(out, "Per-hop latency")
    assert [r[0] for r in latency] == names
    for row in latency:
        assert all(_num(c) > 0 for c in row[1:7]), row  # via / direct p50, p90 and p99
    assert all(_num(row[10]) > 0 for row in latency[:4])  # added / direct
    assert all(row[11] in ("met", "missed") for row in latency[:4])

    ceiling = _table(out, "In-process ControllerLoop")
    assert [r[0] for r in ceiling] == list(METHODS)
    assert all(_num(c) > 0 for row in ceiling for c in row[1:4])
    assert all(_num(r[1]) > 0 for r in _table(out, "cProfile of run_forever"))
    steps = _table(out, "Cost of each step alone")
    assert len(steps) >= 8 and all(_num(r[1]) > 0 for r in steps)

    balance = _table(out, "Balance quality")
    assert [r[0] for r in balance[:4]] == list(METHODS)
    assert any(r[0] == "total_requests" and r[1] == "every request" for r in balance)
    for row in balance:
        ratios = [_num(row[i]) for i in (3, 5, 7, 9)]  # request / token ratio: mean, worst
        assert all(1.0 <= x <= 4.0 + 1e-9 for x in ratios), row
        assert all(_num(c) > 0 for c in row[11:14]), row  # completion times


def test_balance_simulation_is_deterministic():
    bench = _load_bench()
    ns = bench.parse_args(["--quick", "--sim-seconds", "2"])
    wl = bench.make_workload(ns, seed=7)
    assert wl.arrivals == sorted(wl.arrivals) and len(wl.arrivals) > 50
    assert bench.make_workload(ns, seed=7).tokens == wl.tokens
    a = bench.simulate(wl, "total_tokens", 0.02, ns)
    b = bench.simulate(wl, "total_tokens", 0.02, ns)
    assert a.req_ratios == b.req_ratios and a.completion_ms == b.completion_ms
    assert all(t > 0 for t in a.completion_ms)  # every request finished
    rr = bench.simulate(wl, "round_robin", 0.02, ns)
    assert len(rr.completion_ms) == len(wl.arrivals)


def test_benchmark_front_end_sends_what_the_real_front_end_sends(tmp_path):
    """The controllers are fed `scheduler_input.controller_frames` (FrontEnd's own helper); the
    direct path and the "before" rows get single frames; `--reference` extracts a commit's
    `common/` and detects its framing."""
    import random

    from common.messages import scheduler_input as si

    bench = _load_bench()
    reqs = bench.make_requests(3, "follow_bootstrap_room", 16, random.Random(0))
    assert all(r.bootstrap_room is not None for r in reqs)
    assert bench.frame_requests(reqs, "controller") == [si.controller_frames([r]) for r in reqs]
    assert bench.frame_requests(reqs, "single") == [[si.encoder.encode(r)] for r in reqs]
    ref = bench.extract_reference("HEAD", str(tmp_path))
    assert (Path(ref.root) / "common" / "dp" / "controller.py").is_file()
    assert ref.framing in bench.FRAMINGS and ref.transport in ("stream", "zmq")
