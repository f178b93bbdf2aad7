"""Child processes for the one-writer tests: each opens a store (or starts a real ``Gateway``)
over ``$HERMES_HOME/config.yaml`` and reports what happened to the parent.

The children fork from the gateway driver's server (``FORKS``), so a start costs no imports.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.process
import os
import traceback
from pathlib import Path
from typing import Any

from hermes_core import GatewayConfig, create_plugin_manager
from hermes_core.domain.errors import GatewayLockedError
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from support.gateway_driver import FORKS

CHILD_TIMEOUT = 30.0


def configure(home: Path, url: str) -> None:
    """A state directory whose ``config.yaml`` points at ``url`` (housekeeping stays idle)."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    settings = {
        "storage": {"url": url},
        "gateway": {"housekeeping": {"initial_delay_secs": 3600}},
    }
    (home / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")


def _config(home: str) -> GatewayConfig:
    return GatewayConfig.load(environ={"HERMES_HOME": home})


def _race(
    action: str,
    home: str,
    start: Any,
    results: Any,
    done: Any,
) -> None:
    """As soon as every racer is ready, start a real ``Gateway`` (``write``) or open a
    read-only store (``read``), report, then keep it running until the parent has every report
    (a writer holds its lock while the others try)."""
    start.wait(CHILD_TIMEOUT)
    config = _config(home)
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)

    async def run() -> None:
        try:
            if action == "read":
                store = SessionStore.open(config, plugins=plugins, read_only=True)
                stop: Any = store.close
            else:
                gateway = Gateway(
                    config, plugins, lambda entry: EchoAgent(), [InMemoryAdapter("telegram")]
                )
                await gateway.start()
                store, stop = gateway.store, gateway.stop
        except GatewayLockedError as exc:
            results.put((os.getpid(), "locked", str(exc)))
            return
        except Exception:  # noqa: BLE001 - any other failure is what the parent reports
            results.put((os.getpid(), "error", traceback.format_exc()))
            return
        try:
            lanes = len(store.list_sessions())
            results.put((os.getpid(), "reader" if action == "read" else "writer", str(lanes)))
            await asyncio.to_thread(done.wait, CHILD_TIMEOUT)
        finally:
            result = stop()
            if asyncio.iscoroutine(result):
                await result

    asyncio.run(run())


def _hold(role: str, home: str, ready: Any, release: Any) -> None:
    """Hold the writer lock as a plain store or a started ``Gateway`` until released (or
    killed)."""
    config = _config(home)
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    if role == "store":
        with SessionStore.open(config, plugins=plugins):
            ready.set()
            release.wait(CHILD_TIMEOUT)
        return

    async def serve() -> None:
        gateway = Gateway(config, plugins, lambda entry: EchoAgent(), [InMemoryAdapter("telegram")])
        await gateway.start()
        ready.set()
        await asyncio.to_thread(release.wait, CHILD_TIMEOUT)
        await gateway.stop()

    asyncio.run(serve())


class Holder:
    """A child process holding a database's writer lock (``role``: ``store`` or ``gateway``)."""

    def __init__(self, role: str, home: Path) -> None:
        self.ready = FORKS.Event()
        self.release = FORKS.Event()
        self.process: multiprocessing.process.BaseProcess = FORKS.Process(
            target=_hold, args=(role, str(home), self.ready, self.release)
        )
        self.process.start()
        if not self.ready.wait(CHILD_TIMEOUT):
            self.process.kill()
            raise AssertionError(f"the {role} child did not start (exit {self.process.exitcode})")

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def stop(self) -> int | None:
        """Let it close its store and exit; its exit code."""
        self.release.set()
        self.process.join(CHILD_TIMEOUT)
        return self.process.exitcode

    def kill(self) -> int | None:
        """SIGKILL: no close, no cleanup; the lock must go with the process."""
        self.process.kill()
        self.process.join(CHILD_TIMEOUT)
        return self.process.exitcode


def race(action: str, homes: list[Path]) -> list[tuple[int, str, str]]:
    """Start one child per home, let them start a gateway (``write``) or open the store
    read-only (``read``) at the same moment, and return every child's (pid, outcome,
    detail)."""
    start, done = FORKS.Event(), FORKS.Event()
    results = FORKS.Queue()
    children = [
        FORKS.Process(target=_race, args=(action, str(home), start, results, done))
        for home in homes
    ]
    for child in children:
        child.start()
    start.set()
    try:
        reports = [results.get(timeout=CHILD_TIMEOUT) for _ in children]
    finally:
        done.set()
        for child in children:
            child.join(CHILD_TIMEOUT)
            if child.exitcode is None:
                child.kill()
    return reports
