"""Benchmark suites for python -m cuinfer.bench (one module per suite)."""
