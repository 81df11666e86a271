"""Benchmark commands; each prints its figures and is recorded in docs/benchmarks.md."""
