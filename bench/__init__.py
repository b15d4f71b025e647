"""Benchmarks of the whole voice agent, run as modules (`python -m bench.latency`)."""
