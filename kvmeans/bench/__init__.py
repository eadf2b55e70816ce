"""Benchmarks for kvmeans: operator timings (``python -m kvmeans.bench.ops``) and their reports."""
