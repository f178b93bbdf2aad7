"""``hermes-sessions serve`` in a child process for the connector tests: started with a
configuration file and the credentials' environment (optionally a crash point), its output
collected by a thread, stopped with SIGTERM or killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

WAIT_SECS = 60.0


class ServeChild:
    """One ``serve`` process (``python -m hermes_core serve --config CONFIG``)."""

    def __init__(
        self, home: Path, config: Path, environ: Mapping[str, str], crash_at: str | None = None
    ) -> None:
        child_environ = {**os.environ, "HERMES_HOME": str(home), **environ}
        child_environ.pop("HERMES_CRASH_AT", None)
        if crash_at:
            child_environ["HERMES_CRASH_AT"] = crash_at
        self.child = subprocess.Popen(
            [sys.executable, "-m", "hermes_core", "serve", "--config", str(config)],
            env=child_environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def until(self, condition: Callable[[], bool], secs: float = WAIT_SECS) -> None:
        """Wait for ``condition``; an ``AssertionError`` with the output when the child exited
        or the time ran out first."""
        deadline = time.monotonic() + secs
        while not condition():
            if self.child.poll() is not None and not condition():
                raise AssertionError(f"serve exited ({self.child.returncode}):\n{self.output()}")
            assert time.monotonic() < deadline, f"timed out; serve said:\n{self.output()}"
            time.sleep(0.05)

    def wait_serving(self) -> None:
        self.until(lambda: any(line.startswith("serving on ") for line in self.lines))

    def kill(self) -> None:
        """SIGKILL, and wait for it."""
        self.child.kill()
        self.child.wait(WAIT_SECS)

    def stop(self) -> int:
        """SIGTERM, then the exit status (the drain finished: 0)."""
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
        return self.child.wait(WAIT_SECS)
