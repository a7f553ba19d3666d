"""Benchmarks: `jaxserve bench serve` (HTTP load test)."""
