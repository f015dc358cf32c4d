"""Benchmarks: `pagedlm bench throughput | latency | serve | kernel` (see cli.py)."""
