"""Programs the tests run in subprocesses (they must be importable by path, not installed)."""
