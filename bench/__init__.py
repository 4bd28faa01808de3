"""Benchmarks: abort latency, throughput and memory footprint (see docs/performance.md)."""
