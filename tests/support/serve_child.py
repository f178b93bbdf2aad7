"""``hermes-sessions serve`` in a child process for the connector process tests: started with
a configuration file and the credentials' environment (optionally a crash point), its output
collected by a thread, waited on with deadlines (generous: the test machine may be loaded),
stopped with SIGTERM or killed; every failure says what the child printed."""

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
SERVING = "serving on "


class ServeChild:
    """One ``serve`` process (``python -m hermes_core serve --config CONFIG``) with
    ``HERMES_HOME=home``, ``environ`` and no other ``HERMES_*`` variable of the test's own."""

    def __init__(
        self, home: Path, config: Path, environ: Mapping[str, str], crash_at: str | None = None
    ) -> None:
        child_environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
        child_environ.update(environ, HERMES_HOME=str(home))
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

    def wait_serving(self) -> str:
        """The app's URL, once the child printed ``serving on <url>``."""
        self.until(lambda: any(line.startswith(SERVING) for line in self.lines))
        return next(line for line in self.lines if line.startswith(SERVING)).removeprefix(SERVING)

    def wait(self, secs: float = WAIT_SECS) -> int:
        """The exit status once the child exits by itself (a crash point: ``-SIGKILL``); an
        ``AssertionError`` with the output when it is still running at the deadline."""
        try:
            return self.child.wait(secs)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait(WAIT_SECS)
            raise AssertionError(f"serve did not exit; it said:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL, and wait for it."""
        self.child.kill()
        self.child.wait(WAIT_SECS)

    def stop(self) -> int:
        """SIGTERM, then the exit status (the drain finished: 0); killed when it does not exit
        by the deadline."""
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
        return self.wait()
