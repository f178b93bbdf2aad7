"""Housekeeping over many rows goes in short writer steps: a turn of another lane runs between
them instead of waiting for the whole pass."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.domain.models import MessageEvent
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects import sqlite_fts

SEEN_ROWS = 200_000
"""Platform message ids past the redelivery window: what the pass forgets."""


def _config(home: Path) -> GatewayConfig:
    return GatewayConfig.from_dict(
        {
            "gateway": {
                "housekeeping": {"initial_delay_secs": 0, "interval_secs": 3600},
                "session_store_max_age_days": 1,
            }
        },
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


async def _answered_mid_pass(
    home: Path, left: Callable[[], int], untouched: int, done: int
) -> Gateway:
    """Start a gateway (housekeeping's first pass starts at once), wait until the pass has
    begun (``left()`` drops below ``untouched``), then check that a turn of lane 7 is answered
    while the pass still has rows left (``left() > done``) and that the pass ends (``done``).
    Returns the running gateway for the caller's last checks."""
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(_config(home), fresh_plugin_manager(home), lambda _: EchoAgent(), [adapter])
    await gateway.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while await asyncio.to_thread(left) >= untouched:
        assert loop.time() < deadline, "the housekeeping pass never started"
        await asyncio.sleep(0.01)
    await gateway.handle_message(MessageEvent(source=telegram_dm("7"), text="still there?"))
    while adapter.texts("7") != ["echo: still there?"]:
        assert loop.time() < deadline, "the turn was never answered"
        await asyncio.sleep(0.01)
    # Answered while the pass still had rows left: its steps ran between the pass's.
    assert await asyncio.to_thread(left) > done
    while await asyncio.to_thread(left) > done:
        assert loop.time() < deadline, "the pass never finished"
        await asyncio.sleep(0.05)
    return gateway


@pytest.mark.slow
async def test_a_turn_is_answered_between_the_batches_of_a_long_housekeeping_pass(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hermes_core.store.queue_rows.MAINTENANCE_BATCH", 100)  # 2,000 steps
    await asyncio.to_thread(_fill, hermes_home)
    gateway = await _answered_mid_pass(hermes_home, lambda: _expired_ids(hermes_home), SEEN_ROWS, 0)
    assert await gateway.stop()


MESSAGES = 100_000


def _watermark(home: Path) -> int:
    with sqlite3.connect(home / "state.db") as db:
        query = "SELECT value FROM state_meta WHERE key = 'fts_indexed_through'"
        return int(db.execute(query).fetchone()[0])


@pytest.mark.slow
def test_a_search_index_rebuild_goes_in_batches_with_other_steps_between(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fts, "CATCH_UP_MAX", 500)  # a rebuild of 200 steps
    config = _config(hermes_home)
    with SessionStore.open(config) as store:
        session_id = store.get_or_create_session(telegram_dm("1")).session_id
    with sqlite3.connect(hermes_home / "state.db") as db:  # many messages, in bulk
        db.executemany(
            "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, 'user', ?, ?)",
            ((session_id, f"note {n} about kiwis", 1000.0 + n) for n in range(MESSAGES)),
        )
        db.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES ('fts_stale', '1')")
    store = SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home))
    try:
        assert store.health()["fts"] == "stale"
        with ThreadPoolExecutor(1) as pool:
            rebuilding = pool.submit(store.rebuild_search_index)
            deadline = time.monotonic() + 60
            while _watermark(hermes_home) == 0 and not rebuilding.done():
                assert time.monotonic() < deadline, "the rebuild never started"
                time.sleep(0.005)
            other = store.get_or_create_session(telegram_dm("2"))  # writer steps of a turn
            store.append_to_transcript(other.session_id, {"role": "user", "content": "hello"})
            assert _watermark(hermes_home) < MESSAGES  # they ran between the rebuild's batches
            assert rebuilding.result(timeout=60)
        assert _watermark(hermes_home) > MESSAGES - sqlite_fts.INDEX_EVERY
        assert store.health()["fts"] == "ok"
        assert [hit.session_id for hit in store.search("note 99999 kiwis")] == [session_id]
        assert len(store.search("kiwis", limit=100)) == 100
        assert [hit.session_id for hit in store.search("hello")] == [other.session_id]
    finally:
        store.close()


LANES = 20_000
"""Routing entries idle for longer than ``session_store_max_age_days``: what the pass prunes."""


def _routes(home: Path) -> dict[str, tuple[str, float]]:
    with sqlite3.connect(home / "state.db") as db:
        rows = db.execute("SELECT session_key, session_id, updated_at FROM gateway_routing")
        return {key: (session_id, updated_at) for key, session_id, updated_at in rows}


def _idle_lanes(home: Path, last: str) -> str:
    """Many idle routing entries, copied in bulk from one real lane (a gateway would take
    hours to make them), and the real lane ``last``, idle too and last in key order; the
    session id of ``last``."""
    with SessionStore.open(_config(home)) as store:
        session_id = store.get_or_create_session(telegram_dm(last)).session_id
    with sqlite3.connect(home / "state.db") as db:
        db.execute("UPDATE gateway_routing SET updated_at = 1000.0")
        columns = "session_id, updated_at, revision, entry_json"
        db.executemany(
            f"INSERT INTO gateway_routing (session_key, {columns}) "
            f"SELECT ?, {columns} FROM gateway_routing WHERE session_key = ?",
            (
                (f"agent:main:idle:{n:06d}", f"agent:main:telegram:dm:c={last}")
                for n in range(LANES)
            ),
        )
    return session_id


@pytest.mark.slow
async def test_pruning_goes_in_batches_and_never_removes_a_lane_active_since_the_pass_began(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hermes_core.store.pruning.MAINTENANCE_BATCH", 10)  # 2,000 steps
    session_id = await asyncio.to_thread(_idle_lanes, hermes_home, "7")
    active = "agent:main:telegram:dm:c=7"
    # The turn runs on the lane the pass has read as idle but not yet reached (it is last).
    gateway = await _answered_mid_pass(hermes_home, lambda: len(_routes(hermes_home)), LANES + 1, 1)
    routes = _routes(hermes_home)
    assert list(routes) == [active]  # every idle lane gone; the active one kept, same session
    assert routes[active][0] == session_id
    assert routes[active][1] > time.time() - 600
    assert await gateway.stop()


OBLIGATIONS = 100_000
"""Delivery-ledger rows given up on, half past retention: what the pass prunes, down to the
row cap (``max_rows``, 500)."""


def _terminal_obligations(home: Path) -> int:
    with sqlite3.connect(home / "state.db") as db:
        query = "SELECT count(*) FROM delivery_obligations WHERE state = 'abandoned'"
        return int(db.execute(query).fetchone()[0])


def _fill_ledger(home: Path) -> None:
    """Many abandoned replies, written in bulk (an outage of many lanes would leave them)."""
    with SessionStore.open(_config(home)):
        pass  # creates the schema
    now = time.time()
    with sqlite3.connect(home / "state.db") as db:
        db.executemany(
            "INSERT INTO delivery_obligations (obligation_id, session_key, platform, content, "
            "origin_kind, state, created_at, updated_at) "
            "VALUES (?, 'agent:main:telegram:dm:c=1', 'telegram', 'hi', 'turn', 'abandoned', ?, ?)",
            ((f"o{n}", 1000.0, now - n if n % 2 else 1000.0) for n in range(OBLIGATIONS)),
        )


@pytest.mark.slow
async def test_ledger_retention_goes_in_batches_with_a_turn_between(
    hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hermes_core.store.obligations.MAINTENANCE_BATCH", 10)  # 9,950 steps
    await asyncio.to_thread(_fill_ledger, hermes_home)
    gateway = await _answered_mid_pass(
        hermes_home, lambda: _terminal_obligations(hermes_home), OBLIGATIONS, 500
    )
    with sqlite3.connect(hermes_home / "state.db") as db:  # the newest 500 stay
        kept = {row[0] for row in db.execute("SELECT obligation_id FROM delivery_obligations")}
    assert kept == {f"o{n}" for n in range(1, 1000, 2)}
    assert await gateway.stop()


def _pg(url: str) -> Any:
    import psycopg

    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)


_LEFTOVER = "CREATE INDEX ix_messages_search_ccnew ON messages USING gin (search_tsv)"


def _reindex_waiting(url: str) -> bool:
    with _pg(url) as conn:
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'REINDEX%' "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return bool(conn.execute(query).fetchone()[0])


@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_a_turn_is_not_blocked_by_rebuilding_the_postgresql_search_index(
    hermes_home: Path, empty_database: str
) -> None:
    config = GatewayConfig.from_dict(
        {"storage": {"url": empty_database}}, environ={"HERMES_HOME": str(hermes_home)}
    )
    with SessionStore.open(config) as store:
        session_id = store.get_or_create_session(telegram_dm("1")).session_id
        store.append_to_transcript(session_id, {"role": "user", "content": "about kiwis"})
    blocker = _pg(empty_database)  # a reader in a long transaction, using the search index
    blocker.execute("INSERT INTO state_meta (key, value) VALUES ('fts_stale', '1')")
    blocker.autocommit = False
    blocker.execute("SELECT id FROM messages WHERE search_tsv @@ plainto_tsquery('kiwis')")
    store = SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home))
    try:
        assert store.health()["fts"] == "stale"
        with ThreadPoolExecutor(2) as pool:
            rebuilding = pool.submit(store.rebuild_search_index)  # as housekeeping calls it
            try:
                deadline = time.monotonic() + 20  # within its lock wait (lock_timeout: 30 s)
                while not _reindex_waiting(empty_database):
                    assert time.monotonic() < deadline, "the rebuild never waited for the reader"
                    time.sleep(0.05)

                def turn() -> str:  # a turn's writer steps
                    other = store.get_or_create_session(telegram_dm("2"))
                    store.append_to_transcript(
                        other.session_id, {"role": "user", "content": "hello kiwis"}
                    )
                    return other.session_id

                other_id = pool.submit(turn).result(timeout=10)
                assert _reindex_waiting(empty_database)  # the rebuild was still under way
            finally:
                blocker.rollback()  # the reader ends; the rebuild finishes
                blocker.close()
            assert rebuilding.result(timeout=60)
        assert store.health()["fts"] == "ok"
        with _pg(empty_database) as conn:  # what an interrupted concurrent rebuild leaves
            conn.execute(_LEFTOVER)
            conn.execute(
                "UPDATE pg_index SET indisvalid = false "
                "WHERE indexrelid = 'ix_messages_search_ccnew'::regclass"
            )
            assert store.rebuild_search_index()  # drops it first
            query = "SELECT relname FROM pg_class WHERE relname LIKE 'ix_messages_search%'"
            assert [row[0] for row in conn.execute(query)] == ["ix_messages_search"]
        assert {hit.session_id for hit in store.search("kiwis")} == {session_id, other_id}
    finally:
        store.close()
