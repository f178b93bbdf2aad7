"""An operator command killed midway: ``hermes-sessions ARGS`` in a child process that SIGKILLs
itself once a patched method has returned a given number of times (a kill at a known point,
whatever the machine's load: one timed from outside could come after the work had finished)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def dies_after(where: str, calls: int, *, when: str = "True", setup: str = "") -> str:
    """Python source that runs ``setup``, then patches the method ``where``
    (``module:Class.method``) so that the process SIGKILLs itself once ``calls`` of its calls
    for which ``when`` (an expression of its arguments after ``self``, ``args``) holds have
    returned."""
    module, _, attribute = where.partition(":")
    owner, _, method = attribute.partition(".")
    return f"""
import os, signal
from {module} import {owner}
{setup}
patched = {owner}.{method}
returned = []
def then_die(self, *args):
    result = patched(self, *args)
    if {when}:
        returned.append(1)
        if len(returned) == {calls}:
            os.kill(os.getpid(), signal.SIGKILL)
    return result
{owner}.{method} = then_die
"""


def run_killed(patch: str, argv: list[str], env: dict[str, str]) -> int:
    """Run ``hermes-sessions ARGV`` in a child process with ``patch`` (:func:`dies_after`)
    applied first; its exit status (``-SIGKILL`` when the patch killed it)."""
    script = (
        f"{patch}\nimport sys\nfrom hermes_core.cli.main import main\nsys.exit(main({argv!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], env=env, timeout=120, check=False,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ).returncode  # fmt: skip


def killed_when(argv: list[str], ready: Callable[[subprocess.Popen[bytes]], bool]) -> None:
    """Run ``hermes-sessions ARGV`` in a child process and SIGKILL it as soon as ``ready(child)``
    holds (polled; the child must not end first, and it must hold within 120 s)."""
    script = Path(sys.executable).with_name("hermes-sessions")
    child = subprocess.Popen(
        [str(script), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not ready(child):
            assert child.poll() is None, f"hermes-sessions {argv[0]} ended before the kill"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
