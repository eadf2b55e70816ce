"""Benchmarks for kvmeans: operator timings (``kvmeans bench ops``) and their reports."""
