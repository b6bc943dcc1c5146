"""Benchmarks: latency, throughput, serving load, and the transformers baseline."""
