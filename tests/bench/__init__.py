"""Smoke test of the benchmark harness."""
