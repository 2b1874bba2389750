"""Benchmarks of the served pipeline: `python -m bench.run` (see bench/run.py); `make bench`."""
