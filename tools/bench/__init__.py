"""Benchmarks (never in CI, never installed): run from the repo root as ``python -m tools.bench --mode=...`` or ``python -m tools.bench.X``."""
