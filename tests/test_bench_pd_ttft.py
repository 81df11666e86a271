"""Smoke test of `benchmarks/bench_pd_ttft.py --quick` on the tiny Llama model: real colocated,
prefill and decode services answer, the in-process phase split runs over the tcp backend, and
both tables hold the expected rows of positive figures.

The benchmark runs as a subprocess (it starts three service process trees, transfer threads
and scheduler-like loop threads; keeping them out of the pytest process avoids leaking any of
them into other tests). Most of its time is the three services starting at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_pd_ttft.py"


def _table(out: str, title: str) -> list[list[str]]:
    """The body rows (cells) of the markdown table under the heading containing `title`."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("#") and title in ln)
    table: list[str] = []
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            table.append(ln)
        elif table:
            break
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table[2:]]


def _num(cell: str) -> float:
    return float(re.sub(r"[ ,+]", "", cell))


@pytest.mark.timeout(120)
def test_quick_benchmark_prints_both_tables(tiny_llama_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--model-path", str(tiny_llama_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=115,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"\(\d{4}-\d\d-\d\d \d\d:\d\d, .*python .*torch ", out), out[:300]

    e2e = _table(out, "End to end")
    assert [(r[0], r[1]) for r in e2e] == [("16", "colocated"), ("16", "PD tcp"),
                                           ("128", "colocated"), ("128", "PD tcp")]
    for row in e2e:
        p50, p90, low = (_num(c) for c in row[2:5])
        assert 0 < low <= p50 <= p90, row
        if row[1] == "colocated":
            assert row[5:] == ["-", "-", "-"], row
        else:
            _num(row[5]), _num(row[6])  # paired differences: any sign
            assert _num(row[7]) > 0, row  # prefill answered

    phases = _table(out, "split by phase")
    assert [(r[0], r[1]) for r in phases] == [("16", "colocated"), ("16", "PD tcp"),
                                              ("128", "colocated"), ("128", "PD tcp")]
    for row in phases:
        total = _num(row[3])
        assert 0 < total <= _num(row[4]), row
        if row[1] == "colocated":
            assert _num(row[7]) == total and row[5] == row[6] == row[8] == row[11] == "-", row
        else:
            assert _num(row[2]) > 0, row  # KV MiB
            parts = [_num(c) for c in row[5:11]]  # bootstrap .. adopt
            assert all(p >= 0 for p in parts), row
            assert parts[2] > 0 and parts[3] > 0, row  # prefill forward, transfer
            assert 0 < _num(row[11]) <= total, row  # added by PD
            _num(row[12])  # PD - colocated: any sign
    assert "run time" in out
