"""Smoke test of `benchmarks/bench_engine.py --quick`: runs in process on the tiny Llama model
and checks that it prints a markdown table of positive throughputs for every batch size."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_engine.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_engine", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_quick_benchmark_prints_positive_table(capsys):
    bench = _load_bench()
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out

    assert "torch" in out and "threads" in out and "CPU:" in out
    table = [ln for ln in out.splitlines() if ln.startswith("| tiny |")]
    assert [int(ln.split("|")[2]) for ln in table] == [1, 8]
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        # engine prefill, HF prefill, ratio, engine decode, HF decode, ratio
        numbers = [float(re.sub(r"x$", "", c)) for c in cells[4:10]]
        assert all(n > 0 for n in numbers), line
        same, batch = cells[10].split("/")
        assert 0 <= int(same) <= int(batch)

    assert len(rows) == 2
    for row in rows:
        assert row.engine.prefill_s > 0 and row.engine.decode_s > 0
        assert all(len(o) == row.new_tokens for o in row.engine.outputs)
        assert all(len(o) == row.new_tokens for o in row.hf.outputs)
