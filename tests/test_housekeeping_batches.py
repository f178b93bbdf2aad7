"""Housekeeping over many rows goes in short writer steps: a turn of another lane runs between
them instead of waiting for the whole pass."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from hermes_core import GatewayConfig
from hermes_core.agents import EchoAgent, InMemoryAdapter
from hermes_core.models import MessageEvent
from hermes_core.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm

SEEN_ROWS = 200_000
"""Platform message ids past the redelivery window: what the pass forgets."""


def _config(home: Path) -> GatewayConfig:
    return GatewayConfig.from_dict(
        {"gateway": {"housekeeping": {"initial_delay_secs": 0, "interval_secs": 3600}}},
        environ={"HERMES_HOME": str(home)},
    )


def _expired_ids(home: Path) -> int:
    with sqlite3.connect(home / "state.db") as db:
        return int(db.execute("SELECT count(*) FROM seen_messages").fetchone()[0])


def _fill(home: Path) -> None:
    """Many expired redelivery rows, written in bulk (a gateway would take hours to)."""
    with SessionStore.open(_config(home)):
        pass  # creates the schema
    with sqlite3.connect(home / "state.db") as db:
        rows = ((f"agent:main:telegram:dm:c={n % 500}", str(n), 1000.0) for n in range(SEEN_ROWS))
        db.executemany(
            "INSERT INTO seen_messages (session_key, message_id, seen_at) VALUES (?, ?, ?)", rows
        )


async def test_a_turn_is_answered_between_the_batches_of_a_long_housekeeping_pass(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hermes_core.store.turns.MAINTENANCE_BATCH", 100)  # a pass of 2,000 steps
    await asyncio.to_thread(_fill, hermes_home)
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(
        _config(hermes_home), fresh_plugin_manager(hermes_home), lambda _: EchoAgent(), [adapter]
    )
    await gateway.start()  # housekeeping's first pass starts at once
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (left := await asyncio.to_thread(_expired_ids, hermes_home)) == SEEN_ROWS:
        assert loop.time() < deadline, "the housekeeping pass never started"
        await asyncio.sleep(0.01)
    assert left > 0, "the pass forgot every row in one step"
    await gateway.handle_message(MessageEvent(source=telegram_dm("7"), text="still there?"))
    while adapter.texts("7") != ["echo: still there?"]:
        assert loop.time() < deadline, "the turn was never answered"
        await asyncio.sleep(0.01)
    # Answered while the pass still had rows to forget: its steps ran between the pass's.
    assert await asyncio.to_thread(_expired_ids, hermes_home) > 0
    while await asyncio.to_thread(_expired_ids, hermes_home) > 0:
        assert loop.time() < deadline, "the pass never finished"
        await asyncio.sleep(0.05)
    assert await gateway.stop()
