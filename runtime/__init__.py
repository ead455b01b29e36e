"""Thin runtime: KV cache, scheduling, drafting on host, sampling, metrics."""
