"""Benchmarks: scripts that print figures; they are not tests."""
