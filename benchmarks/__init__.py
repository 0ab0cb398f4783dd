"""Benchmarks for adaloss. ``python -m benchmarks`` (``make bench``) runs :mod:`benchmarks.step_time`."""
