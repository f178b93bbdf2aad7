"""The gateway side of ``benchmarks.bench_instances``: the body of each spawned gateway process.

A process runs a real ``hermes_core.gateway.runtime.Gateway`` on the run's database, takes the
driver's commands from a pipe (``message``, ``idle``, ``stop``) and reports each reply its adapter
sent (chat, text, when), the stats once idle, and at the end when each turn began and each message
arrived (``CLOCK_MONOTONIC``: the driver is on the same host).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hermes_core import GatewayConfig, MessageEvent, SessionEntry, SessionSource
from hermes_core.gateway.agents import EchoAgent, TurnRequest
from hermes_core.gateway.runtime import Gateway
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.turns.ledger import SendResult

IDLE_SECS = 60.0
"""How long an ``idle`` command waits for the turns to close and the leases to go."""


@dataclass(frozen=True)
class Setup:
    """What every gateway process of a run is given."""

    url: str
    instances: str
    lease_scan_secs: float
    writer_connections: int | None = None
    """``storage.writer_connections`` (None: the default, 2 single and 1 shared)."""

    @property
    def label(self) -> str:
        """The configuration as the table names it: ``single``, ``shared``, or with the writer
        connections set, e.g. ``single/1w``."""
        if self.writer_connections is None:
            return self.instances
        return f"{self.instances}/{self.writer_connections}w"


def _config(home: Path, setup: Setup) -> GatewayConfig:
    storage: dict[str, Any] = {"url": setup.url, "instances": setup.instances}
    if setup.writer_connections is not None:
        storage["writer_connections"] = setup.writer_connections
    settings = {
        "storage": {**storage, "lease_scan_secs": setup.lease_scan_secs},
        "gateway": {
            "housekeeping": {"initial_delay_secs": 1e6},
            "busy_ack_enabled": False,
            "write_sessions_json": False,
            "busy_queue": {"burst_window_secs": 0},
        },
        "display": {"busy_input_mode": "queue"},
        "plugins": {"autoload": False},
    }
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


class ThinkingAgent(EchoAgent):
    """Echo after the think time the message id names (``m<number>-<milliseconds>``: the
    process that runs a turn may not be the one that received its message), recording when
    each turn started."""

    def __init__(self, starts: dict[str, float]) -> None:
        super().__init__()
        self.starts = starts

    async def run_turn(self, request: TurnRequest) -> str | None:
        message_id = str(request.event.message_id)
        self.starts[message_id] = time.monotonic()
        self.delay = int(message_id.rpartition("-")[2]) / 1000
        return await super().run_turn(request)


class PipeAdapter:
    """Tells the driver of every reply sent (chat, text, when)."""

    platform = "telegram"

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        self.conn.send(("reply", source.chat_id, text, time.monotonic()))
        return SendResult(ok=True)


def _source(chat: str) -> SessionSource:
    return SessionSource(platform="telegram", chat_id=chat, chat_type="dm", user_id=chat)


async def _serve(home: Path, setup: Setup, conn: Connection) -> None:
    config = _config(home, setup)
    starts: dict[str, float] = {}
    arrivals: dict[str, float] = {}

    def agent(entry: SessionEntry) -> ThinkingAgent:
        return ThinkingAgent(starts)

    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    gateway = Gateway(config, plugins, agent, [PipeAdapter(conn)])
    await gateway.start()
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def readable() -> None:
        try:
            while conn.poll():
                commands.put_nowait(conn.recv())
        except EOFError:  # the driver is gone
            loop.remove_reader(conn.fileno())
            commands.put_nowait(("stop",))

    async def handle(message_id: str, chat: str, words: str) -> None:
        arrivals[message_id] = time.monotonic()
        event = MessageEvent(source=_source(chat), text=words, message_id=message_id)
        try:
            await gateway.handle_message(event)
        except Exception as exc:  # noqa: BLE001 - the driver fails the run with it
            conn.send(("error", f"{message_id}: {exc!r}"))

    tasks: set[asyncio.Task[None]] = set()
    loop.add_reader(conn.fileno(), readable)
    conn.send(("ready", os.getpid()))
    while (command := await commands.get())[0] != "stop":
        if command[0] == "message":
            task = asyncio.create_task(handle(*command[1:]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:  # "idle": every turn closed, every lease given back
            deadline = time.monotonic() + IDLE_SECS
            await gateway.idle()
            while (tasks or gateway.store._leases.held_lanes()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                await gateway.idle()
            conn.send(("idle", gateway.store.stats(), len(gateway.store._leases.held_lanes())))
    loop.remove_reader(conn.fileno())
    await gateway.stop()
    conn.send(("done", starts, arrivals))


def gateway_process(home: str, setup: Setup, conn: Connection) -> None:
    """A gateway process's body: serve the driver's messages until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(Path(home), setup, conn))
