"""SQL-only store behaviour on SQLite and (when configured) PostgreSQL: search, transcript
edits, pruning, lane rebuilds from session rows, schema versions and the sessions.json mirror."""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, delete, update
from sqlalchemy.dialects import sqlite
from support.database import run_sql

from hermes_core import GatewayConfig, MessageEvent
from hermes_core.domain.errors import (
    InvalidValueError,
    MessageRedeliveredError,
    SchemaVersionError,
    StoreUnavailableError,
    TurnInProgressError,
)
from hermes_core.store import SessionStore
from hermes_core.store.backend import STREAM_METADATA
from hermes_core.store.mirror import MIRROR_README
from hermes_core.store.operator import LaneFilter
from hermes_core.testing import LifecycleRecorder, fresh_plugin_manager, telegram_dm
from hermes_plugins import sql_store
from hermes_plugins.sql_store.dialects import dialect_for
from hermes_plugins.sql_store.schema import SCHEMA_VERSION, messages, queued_events
from hermes_plugins.sql_store.statements import Prepared

Opener = Callable[..., SessionStore]


@pytest.fixture
def backend(settings: dict[str, Any]) -> str:
    """The backend of the test's stores (:func:`conftest.settings`' parameter)."""
    return "postgresql" if settings else "sqlite"


def sql(store: SessionStore, statement: str, **params: Any) -> list[Any]:
    """Run raw SQL against the store's database (to arrange states the API never creates)."""
    return run_sql(store.config.storage_url, statement, **params)


# -- search ------------------------------------------------------------------------------------


def test_search_finds_active_messages_with_scopes(open_store: Opener) -> None:
    store = open_store()
    one = store.get_or_create_session(telegram_dm("1"))
    two = store.get_or_create_session(telegram_dm("2"))
    store.append_to_transcript(one.session_id, {"role": "user", "content": "the quick brown fox"})
    store.append_to_transcript(two.session_id, {"role": "assistant", "content": "a brown dog"})
    store.append_to_transcript(two.session_id, {"role": "tool", "tool_name": "fetch_weather",
                                                "content": "sunny"})  # fmt: skip
    assert {hit.session_id for hit in store.search("brown")} == {one.session_id, two.session_id}
    assert [hit.session_id for hit in store.search("brown fox")] == [one.session_id]
    assert [h.session_id for h in store.search("brown", session_id=two.session_id)] == [
        two.session_id
    ]
    assert [h.session_id for h in store.search("brown", session_key=one.session_key)] == [
        one.session_id
    ]
    assert [hit.role for hit in store.search("fetch_weather")] == ["tool"]
    hit = store.search("quick")[0]
    assert "quick" in hit.snippet
    assert len(hit.snippet) <= 200
    assert hit.message_id > 0
    assert store.search('he said "hi') == []  # quotes never break the query
    assert store.search("   ") == []
    assert len(store.search("brown", limit=1)) == 1


def test_search_limit_is_capped(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    for i in range(105):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": f"needle {i}"})
    assert len(store.search("needle", limit=500)) == 100
    assert len(store.search("needle")) == 20


# -- transcript edits ----------------------------------------------------------------------------


def test_rewrite_deactivates_and_appends(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    for content in ("one", "two", "three"):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": content})
    token = store.mark_turn_active(entry.session_key)
    assert token is not None
    with pytest.raises(TurnInProgressError):
        store.rewrite_transcript(entry.session_id, [{"role": "user", "content": "x"}])
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == [
        "one",
        "two",
        "three",
    ]
    assert store.clear_turn_active(entry.session_key, token)
    count = store.rewrite_transcript(entry.session_id, [{"role": "user", "content": "uno"}])
    assert count == 1
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["uno"]
    assert store.search("two") == []
    rows = sql(store, "SELECT count(*) FROM messages WHERE session_id = :s", s=entry.session_id)
    assert rows[0][0] == 4  # nothing was deleted
    with pytest.raises(InvalidValueError, match="does not exist"):
        store.rewrite_transcript("20200101_000000_00000000", [])


def test_rewrite_with_force_while_a_turn_runs(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.mark_turn_active(entry.session_key)
    assert store.rewrite_transcript(
        entry.session_id, [{"role": "user", "content": "a"}], force=True
    )
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["a"]


def test_fields_without_a_column_round_trip_in_order(open_store: Opener) -> None:
    """A message's fields without a column come back after the columns', in the message's
    order (structured content among them); its own ``id`` is never stored."""
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(
        entry.session_id,
        {"zeta": 1, "id": 99, "role": "assistant", "alpha": {"b": [None, 2.5]},
         "content": [{"type": "text", "text": "hi"}], "tool_calls": [{"name": "f"}],
         "timestamp": 5},
    )  # fmt: skip
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "plain"})
    first, second = store.load_transcript(entry.session_id)
    assert first["id"] != 99
    assert list(first.items())[1:] == [
        ("role", "assistant"), ("tool_calls", [{"name": "f"}]), ("timestamp", 5.0),
        ("zeta", 1), ("alpha", {"b": [None, 2.5]}), ("content", [{"type": "text", "text": "hi"}]),
    ]  # fmt: skip
    assert [name for name in second if name != "timestamp"] == ["id", "role", "content"]


def test_soft_delete_never_deletes(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    for content in ("keep", "drop"):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": content})
    drop_id = store.load_transcript(entry.session_id)[1]["id"]
    assert store.soft_delete_messages(entry.session_id, [drop_id]) == 1
    assert store.soft_delete_messages(entry.session_id, [drop_id]) == 0
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["keep"]
    rows = sql(store, "SELECT active FROM messages WHERE id = :i", i=drop_id)
    assert rows[0][0] == 0


def test_append_to_unknown_session_is_refused(open_store: Opener) -> None:
    from hermes_core.domain.errors import TranscriptWriteError

    store = open_store()
    with pytest.raises(TranscriptWriteError):
        store.append_to_transcript("20200101_000000_00000000", {"role": "user", "content": "x"})
    entry = store.get_or_create_session(telegram_dm())
    with pytest.raises(InvalidValueError, match="role"):
        store.append_to_transcript(entry.session_id, {"role": "wizard", "content": "x"})


# -- pruning and lane rebuilds -------------------------------------------------------------------


def test_a_new_lane_is_opened_with_its_session_row(open_store: Opener) -> None:
    """A lane's first turn writes its routing row and its open session's row (the statements it
    takes are in the performance contract, tests/test_perf_contract.py)."""
    store = open_store()
    source = telegram_dm("1")
    key = store.session_key_for(source)
    entry, suspended = store._sessions.open_lane(key, source)
    assert not suspended
    assert store.lookup_by_session_key(key) == entry
    row = store.session_row(entry.session_id)
    assert row is not None
    assert row.session_key == key
    assert row.end_reason is None


def test_a_queued_event_and_its_message_id_are_stored_together(open_store: Opener) -> None:
    """The queued event is stored with its platform message id (the redelivery check); a
    redelivered message writes nothing."""
    store = open_store()
    key = store.session_key_for(telegram_dm("1"))
    event = MessageEvent(source=telegram_dm("1"), text="queued", message_id="m1")
    event_id = store._queue.add(key, event)
    with pytest.raises(MessageRedeliveredError):
        store._queue.add(key, event.replace(text="again"))
    internal = MessageEvent(source=telegram_dm("1"), text="wake", internal=True)
    later = store._queue.add(key, internal)  # no message id: nothing to check
    assert [(queued, stored.text) for queued, _, stored in store._queue.restore(key)] == [
        (event_id, "queued"),
        (later, "wake"),
    ]


def test_a_lane_not_cached_is_loaded_from_its_rows(open_store: Opener) -> None:
    """A lane whose entry is not cached (a new process here) is read from the store."""
    first = open_store()
    entry = first.get_or_create_session(telegram_dm("1"))
    first.close()
    store = open_store()
    opened, _ = store._sessions.open_lane(entry.session_key, telegram_dm("1"))
    assert opened.session_id == entry.session_id


@pytest.mark.slow
def test_a_new_session_on_a_pruned_lane_ends_its_open_session(open_store: Opener) -> None:
    """Pruning keeps the lane's session open; a forced new session then ends it (the key may
    have one open session only) instead of failing."""
    store = open_store()
    old = store.get_or_create_session(telegram_dm("idle"))
    time.sleep(0.3)
    assert store.prune_old_entries(2e-6) == 1
    new = store.get_or_create_session(telegram_dm("idle"), force_new=True)
    assert new.session_id != old.session_id
    assert new.prev_session_id == old.session_id
    ended = store.session_row(old.session_id)
    assert ended is not None
    assert ended.end_reason == "session_reset"


@pytest.mark.slow
def test_prune_removes_only_idle_unprotected_routes(open_store: Opener) -> None:
    def active(key: str) -> bool:
        if key.endswith(":c=boom"):
            raise RuntimeError("process table unavailable")
        return key.endswith(":c=busy")

    home_store = open_store()
    home_store.close()
    config = home_store.config
    store = SessionStore(
        config.sessions_dir, config, active, plugins=fresh_plugin_manager(config.hermes_home)
    )
    try:
        lanes = {name: store.get_or_create_session(telegram_dm(name))
                 for name in ("idle", "busy", "boom", "suspended", "marked")}  # fmt: skip
        store.append_to_transcript(lanes["idle"].session_id, {"role": "user", "content": "hi"})
        store.suspend_session(lanes["suspended"].session_key)
        store.mark_turn_active(lanes["marked"].session_key)
        assert store.prune_old_entries(None) == 0
        assert store.prune_old_entries(0) == 0
        time.sleep(0.3)
        assert store.prune_old_entries(2e-6) == 1  # 0.17 s
        assert store.lookup_by_session_key(lanes["idle"].session_key) is None
        for name in ("busy", "boom", "suspended", "marked"):
            assert store.lookup_by_session_key(lanes[name].session_key) is not None
        # Only the mapping went: the next message rebuilds the lane on the same session.
        again = store.get_or_create_session(telegram_dm("idle"))
        assert again.session_id == lanes["idle"].session_id
        assert [m["content"] for m in store.load_transcript(again.session_id)] == ["hi"]
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("end_reason", "expiry_finalized", "reopened"),
    [
        (None, 0, True),
        ("agent_close", 0, True),
        ("lru_evict", 0, True),
        ("session_reset", 0, False),
        ("idle", 0, False),
        ("something_else", 0, False),
        (None, 1, False),
    ],
)
def test_lane_rebuild_from_the_newest_row(
    open_store: Opener, end_reason: str | None, expiry_finalized: int, reopened: bool
) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.update_session(entry.session_key, input_tokens=4, output_tokens=6)
    store.close()
    sql(
        store,
        "UPDATE sessions SET ended_at = :e, end_reason = :r, expiry_finalized = :f, "
        "last_activity_at = 1000 WHERE id = :s",
        e=None if end_reason is None else 2000.0, r=end_reason, f=expiry_finalized,
        s=entry.session_id,
    )  # fmt: skip
    sql(store, "DELETE FROM gateway_routing")
    fresh = open_store()
    lane = fresh.get_or_create_session(telegram_dm())
    assert (lane.session_id == entry.session_id) is reopened
    if reopened:
        assert lane.created_at == entry.created_at
        assert lane.updated_at.timestamp() == 1000  # last activity, never "fresh"
        assert (lane.input_tokens, lane.total_tokens) == (4, 10)
        row = sql(fresh, "SELECT ended_at, end_reason FROM sessions WHERE id = :s",
                  s=entry.session_id)  # fmt: skip
        assert tuple(row[0]) == (None, None)


def test_stale_route_to_an_ended_session_starts_a_new_one(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.close()
    sql(store, "UPDATE sessions SET ended_at = 5, end_reason = 'session_reset' WHERE id = :s",
        s=entry.session_id)  # fmt: skip
    lane = open_store().get_or_create_session(telegram_dm())
    assert lane.session_id != entry.session_id


def test_reset_ends_the_old_row_with_its_reason(open_store: Opener) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "pineapple"})
    new = store.reset_session(entry.session_key)
    assert new is not None
    assert [hit.session_id for hit in store.search("pineapple")] == [entry.session_id]
    rows = sql(store, "SELECT id, end_reason, parent_session_id FROM sessions ORDER BY started_at")
    by_id = {row[0]: (row[1], row[2]) for row in rows}
    assert by_id[entry.session_id] == ("session_reset", None)
    assert by_id[new.session_id] == (None, entry.session_id)


# -- schema versions -----------------------------------------------------------------------------


def test_newer_schema_is_refused_untouched(open_store: Opener) -> None:
    store = open_store()
    store.close()
    sql(store, "UPDATE schema_version SET version = 99")
    newer = rf"schema version 99, newer than version {SCHEMA_VERSION}"
    with pytest.raises(SchemaVersionError, match=newer):
        open_store()
    assert sql(store, "SELECT version FROM schema_version")[0][0] == 99


def test_version_one_database_upgrades_in_place(open_store: Opener, backend: str) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "ancient words"})
    store.close()
    if backend == "sqlite":
        for statement in ("DROP TRIGGER messages_fts_delete", "DROP TRIGGER messages_fts_update",
                          "DROP TABLE messages_fts", "DROP VIEW messages_fts_src",
                          "DELETE FROM state_meta WHERE key = 'fts_indexed_through'"):  # fmt: skip
            sql(store, statement)
    else:
        sql(store, "DROP INDEX ix_messages_search")
        sql(store, "ALTER TABLE messages DROP COLUMN search_tsv")
    sql(store, "DROP TABLE seen_messages")  # and what version 3 added
    for column in ("attempts", "last_error", "dead_at"):
        sql(store, f"ALTER TABLE queued_events DROP COLUMN {column}")
    sql(store, "UPDATE schema_version SET version = 1")
    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert [hit.session_id for hit in upgraded.search("ancient")] == [entry.session_id]
    event = MessageEvent(source=telegram_dm(), text="queued", message_id="m9")
    event_id = upgraded._queue.add(entry.session_key, event)  # the version 3 columns work
    assert upgraded._queue.fail(event_id, "boom") is False
    with pytest.raises(MessageRedeliveredError):
        upgraded._queue.add(entry.session_key, event)
    assert upgraded.health()["fts"] == "ok"


_V5_INDEXES = {
    "ix_delivery_obligations_state": "delivery_obligations (state, platform)",
    "ix_seen_messages_seen_at": "seen_messages (seen_at)",
    "ix_gateway_routing_marker": "gateway_routing (session_key) "
    "WHERE active_turn_token IS NOT NULL",
}


def _indexes(store: SessionStore, backend: str) -> set[str]:
    if backend == "sqlite":
        return {row[0] for row in sql(store, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    return {row[0] for row in sql(store, "SELECT indexname FROM pg_indexes")}


def test_version_five_database_upgrades_in_place(open_store: Opener, backend: str) -> None:
    store = open_store()
    entry = store.get_or_create_session(telegram_dm())
    token = store.mark_turn_active(entry.session_key)
    owed = store._turns.record_delivery_obligation(
        entry.session_key, entry.session_id, "telegram", "99", None, "the reply", "m1",
        reply={"role": "assistant", "content": "the reply"},
    )  # fmt: skip
    event = MessageEvent(source=telegram_dm(), text="queued", message_id="m7")
    store._queue.add(entry.session_key, event)
    store.close()
    if backend == "sqlite":  # version 5 had rowid tables with their own key indexes
        for table in ("delivery_obligations", "seen_messages"):
            ddl = sql(store, "SELECT sql FROM sqlite_master WHERE name = :t", t=table)[0][0]
            sql(store, ddl.replace(f"TABLE {table}", "TABLE v5").replace("WITHOUT ROWID", ""))
            sql(store, f"INSERT INTO v5 SELECT * FROM {table}")
            sql(store, f"DROP TABLE {table}")
            sql(store, f"ALTER TABLE v5 RENAME TO {table}")
    for name, target in _V5_INDEXES.items():
        sql(store, f"CREATE INDEX IF NOT EXISTS {name} ON {target}")
    sql(store, "UPDATE schema_version SET version = 5")
    assert set(_V5_INDEXES) <= _indexes(store, backend)

    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    left = _indexes(upgraded, backend) & set(_V5_INDEXES)
    if backend == "sqlite":  # the marker's index, dropped at version 6, is back since 11
        assert left == {"ix_gateway_routing_marker"}
        for table in ("delivery_obligations", "seen_messages"):
            ddl = sql(upgraded, "SELECT sql FROM sqlite_master WHERE name = :t", t=table)[0][0]
            assert ddl.rstrip().endswith("WITHOUT ROWID")
        assert sql(upgraded, "PRAGMA foreign_key_check") == []
    else:  # PostgreSQL keeps the indexes its several processes scan with
        assert left == {"ix_seen_messages_seen_at", "ix_gateway_routing_marker"}
    ledger = upgraded._obligations.ledger
    assert ledger is not None
    assert owed is not None
    rows = ledger.rows.obligations(["pending"], ["telegram"])
    assert [(row.obligation_id, row.content) for row in rows] == [(owed.obligation_id, "the reply")]
    marked = upgraded._turns.entries_with_fresh_markers(0)
    assert [(lane.session_key, lane.active_turn_token) for lane in marked] == [
        (entry.session_key, token)
    ]
    with pytest.raises(MessageRedeliveredError):  # the seen row came along
        upgraded._queue.add(entry.session_key, event)
    sql(upgraded, "UPDATE seen_messages SET seen_at = 0")
    assert upgraded._queue.prune_seen() == 1


def test_version_six_database_upgrades_in_place(open_store: Opener, backend: str) -> None:
    store = open_store()
    store.close()
    sql(store, "ALTER TABLE session_turn_leases DROP COLUMN waiting")
    sql(store, "INSERT INTO session_turn_leases (session_key, owner_instance, owner_boot, token, "
               "acquired_at, expires_at) VALUES ('k', 'i', 'b', 't', 0, 1)")  # fmt: skip
    sql(store, "UPDATE schema_version SET version = 6")
    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert sql(upgraded, "SELECT session_key, waiting FROM session_turn_leases") == [("k", 0)]


def test_version_seven_database_upgrades_in_place(open_store: Opener, backend: str) -> None:
    store = open_store()
    older = store.get_or_create_session(telegram_dm("1"))
    newer = store.get_or_create_session(telegram_dm("2"))
    store.close()
    sql(store, "DROP INDEX ix_gateway_routing_updated")
    sql(store, "UPDATE schema_version SET version = 7")
    assert "ix_gateway_routing_updated" not in _indexes(store, backend)
    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert "ix_gateway_routing_updated" in _indexes(upgraded, backend)
    operator = upgraded._backing.bound.operator
    assert operator is not None
    rows = operator.lane_rows(LaneFilter(), None, 5)
    assert [row.entry["session_key"] for row in rows] == [newer.session_key, older.session_key]


def test_version_eight_moves_an_owed_streamed_reply_into_its_row(
    open_store: Opener, backend: str
) -> None:
    """Version 8 kept an owed streamed reply's messages in its lane's metadata until the row
    settled; the upgrade moves them into the row, and leaves a cut stream (no row) where it is."""
    store = open_store()
    owed_lane = store.get_or_create_session(telegram_dm("1"))
    cut_lane = store.get_or_create_session(telegram_dm("2"))
    layout = {"messages": [["m1", 0], ["m2", 10]]}
    for lane in (owed_lane, cut_lane):
        store.set_session_metadata(lane.session_key, STREAM_METADATA, layout)
        store.set_session_metadata(lane.session_key, "topic", "kept")
    owed = store._turns.record_delivery_obligation(
        owed_lane.session_key, owed_lane.session_id, "telegram", "1", None, "the reply", "m1"
    )
    assert owed is not None
    store.close()
    sql(store, "ALTER TABLE delivery_obligations DROP COLUMN stream_messages")
    sql(store, "UPDATE schema_version SET version = 8")

    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    ledger = upgraded._obligations.ledger
    assert ledger is not None
    (row,) = ledger.rows.obligations(["pending"])
    assert (row.obligation_id, row.content) == (owed.obligation_id, "the reply")
    assert row.stream_messages is not None
    assert json.loads(row.stream_messages) == layout
    moved = upgraded.lookup_by_session_key(owed_lane.session_key)
    kept = upgraded.lookup_by_session_key(cut_lane.session_key)
    assert moved is not None
    assert kept is not None
    assert moved.metadata == {"topic": "kept"}
    assert kept.metadata == {STREAM_METADATA: layout, "topic": "kept"}


def test_version_nine_indexes_the_lanes_to_resume(open_store: Opener, backend: str) -> None:
    """Version 10 reads the lanes marked to resume through a partial index (a gateway's start
    no longer scans every routing row); the upgrade adds it to a version 9 store."""
    store = open_store()
    lanes = [store.get_or_create_session(telegram_dm(str(user))) for user in range(3)]
    store.mark_resume_pending(lanes[1].session_key, "restart_timeout")
    store.close()
    sql(store, "DROP INDEX ix_gateway_routing_resume")
    sql(store, "UPDATE schema_version SET version = 9")
    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert "ix_gateway_routing_resume" in _indexes(upgraded, backend)
    marked = upgraded.list_sessions(resume_pending=True)
    assert [entry.session_key for entry in marked] == [lanes[1].session_key]
    if backend == "sqlite":
        plan = sql(upgraded, "EXPLAIN QUERY PLAN SELECT session_key FROM gateway_routing "
                   "WHERE resume_pending != 0 ORDER BY session_key")  # fmt: skip
        assert "ix_gateway_routing_resume" in " ".join(str(row) for row in plan)


_V10_COUNT_TRIGGER = {
    "sqlite": (
        "DROP TRIGGER messages_count",
        "CREATE TRIGGER messages_count AFTER INSERT ON messages BEGIN UPDATE sessions SET "
        "message_count = message_count + 1, last_activity_at = new.timestamp "
        "WHERE id = new.session_id; END",
    ),
    "postgresql": (
        "CREATE OR REPLACE FUNCTION hermes_count_message() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN UPDATE sessions SET message_count = message_count + 1, "
        "last_activity_at = NEW.timestamp WHERE id = NEW.session_id; RETURN NULL; END $$",
    ),
}
"""The message-count trigger of schema version 10, which counted a copy's messages too."""
_COUNT_TRIGGER_TEXT = {
    "sqlite": "SELECT sql FROM sqlite_master WHERE name = 'messages_count'",
    "postgresql": "SELECT prosrc FROM pg_proc WHERE proname = 'hermes_count_message'",
}


def test_version_ten_indexes_the_lanes_with_a_turn_marker(open_store: Opener, backend: str) -> None:
    """Version 11 reads the lanes with a turn marker through a partial index on SQLite too (a
    gateway's start no longer scans every routing row), and its message-count trigger skips
    ``migrate``'s copies; the upgrade brings both to a version 10 store, whose markers it
    finds as set and whose messages it counts as before."""
    store = open_store()
    lanes = [store.get_or_create_session(telegram_dm(str(user))) for user in range(3)]
    token = store.mark_turn_active(lanes[2].session_key)
    store.close()
    sql(store, "DROP INDEX ix_gateway_routing_marker")
    for statement in _V10_COUNT_TRIGGER[backend]:
        sql(store, statement)
    assert "copying" not in sql(store, _COUNT_TRIGGER_TEXT[backend])[0][0]
    sql(store, "UPDATE schema_version SET version = 10")
    upgraded = open_store()
    assert sql(upgraded, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert "ix_gateway_routing_marker" in _indexes(upgraded, backend)
    marked = upgraded._turns.entries_with_fresh_markers(0, lanes=None)
    assert [(entry.session_key, entry.active_turn_token) for entry in marked] == [
        (lanes[2].session_key, token)
    ]
    assert "copying" in sql(upgraded, _COUNT_TRIGGER_TEXT[backend])[0][0]
    upgraded.append_to_transcript(lanes[0].session_id, {"role": "user", "content": "hi"})
    counted = "SELECT message_count FROM sessions WHERE id = :id"
    assert sql(upgraded, counted, id=lanes[0].session_id) == [(1,)]
    if backend == "sqlite":
        plan = sql(upgraded, "EXPLAIN QUERY PLAN SELECT session_key FROM gateway_routing "
                   "WHERE active_turn_token IS NOT NULL ORDER BY session_key")  # fmt: skip
        assert "ix_gateway_routing_marker" in " ".join(str(row) for row in plan)


# -- sessions.json mirror ------------------------------------------------------------------------


def test_mirror_is_written_off_the_message_path(open_store: Opener) -> None:
    store = open_store(gateway={"write_sessions_json": True})
    mirror = store.sessions_dir / "sessions.json"
    entry = store.get_or_create_session(telegram_dm())
    assert not mirror.exists()  # creating a session never waits for the mirror
    assert store._fallback.flush_mirror(force=True)
    assert not store._fallback.flush_mirror(force=True)  # nothing changed since
    store.get_or_create_session(telegram_dm("2"))
    assert not store._fallback.flush_mirror()  # within the interval
    store.close()
    data = json.loads(mirror.read_text(encoding="utf-8"))
    assert next(iter(data)) == "_README"
    assert data["_README"] == MIRROR_README
    assert set(data) == {"_README", entry.session_key, "agent:main:telegram:dm:c=2"}
    assert data[entry.session_key]["session_id"] == entry.session_id
    assert stat.S_IMODE(os.stat(mirror).st_mode) == 0o600


def test_mirror_can_be_turned_off(open_store: Opener) -> None:
    store = open_store(gateway={"write_sessions_json": False})
    store.get_or_create_session(telegram_dm())
    store.close()
    assert not (store.sessions_dir / "sessions.json").exists()


def _legacy_mirror(path: Path, entries: dict[str, Any], *, bom: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps({"_README": "old", **entries}, indent=2)
    path.write_bytes(("\ufeff" if bom else "").encode() + body.encode("utf-8"))


V1 = {"schema": "v1"}
"""``keys``: the original gateway's sessions.json holds key schema v1 keys."""


def _legacy_entry(key: str, session_id: str) -> dict[str, Any]:
    return {"session_key": key, "session_id": session_id,
            "created_at": "2026-01-01T00:00:00+00:00", "updated_at": "2026-01-02T00:00:00",
            "origin": {"platform": "telegram", "chat_id": key.rsplit(":", 1)[1]},
            "model_override": "ignored"}  # fmt: skip


@pytest.mark.slow
def test_existing_mirror_is_imported_once(open_store: Opener, tmp_path: Path) -> None:
    mirror = tmp_path / "home" / "sessions" / "sessions.json"
    key = "agent:main:telegram:dm:7"
    _legacy_mirror(mirror, {key: _legacy_entry(key, "20260101_000000_aaaaaaaa"),
                            "agent:main:bad": {"session_key": 5}}, bom=True)  # fmt: skip
    store = open_store(keys=V1)
    entry = store.lookup_by_session_key(key)
    assert entry is not None
    assert entry.session_id == "20260101_000000_aaaaaaaa"
    new = store.get_or_create_session(telegram_dm("7"))
    assert new.session_id == "20260101_000000_aaaaaaaa"
    store.reset_session(key)
    store.close()
    _legacy_mirror(mirror, {key: _legacy_entry(key, "20260101_000000_aaaaaaaa")})
    again = open_store(keys=V1)  # a stale file never brings a reset lane back
    assert again.peek_session_id(key) != "20260101_000000_aaaaaaaa"
    # Explicit import adds only keys the table lacks.
    other = "agent:main:telegram:dm:8"
    _legacy_mirror(mirror, {key: _legacy_entry(key, "20260101_000000_aaaaaaaa"),
                            other: _legacy_entry(other, "20260101_000000_bbbbbbbb")})  # fmt: skip
    assert again.import_sessions_json(mirror) == 1
    assert again.peek_session_id(other) == "20260101_000000_bbbbbbbb"
    assert again.peek_session_id(key) != "20260101_000000_aaaaaaaa"


def test_an_imported_lane_gets_its_session_row(open_store: Opener, tmp_path: Path) -> None:
    mirror = tmp_path / "home" / "sessions" / "sessions.json"
    key, session_id = "agent:main:telegram:dm:7", "20260101_000000_aaaaaaaa"
    entry = {**_legacy_entry(key, session_id), "prev_session_id": "20251231_000000_gone0000"}
    _legacy_mirror(mirror, {key: entry})
    store = open_store(keys=V1)
    row = store.session_row(session_id)
    assert row is not None
    assert (row.session_key, row.parent_session_id) == (key, None)  # the parent never existed
    store.append_to_transcript(session_id, {"role": "user", "content": "after the import"})
    assert [m["content"] for m in store.load_transcript(session_id)] == ["after the import"]
    store.close()


@pytest.mark.parametrize("damage", ["truncated", "moved aside"])
def test_a_lost_database_is_rebuilt_from_the_mirror_with_rows(tmp_path: Path, damage: str) -> None:
    """A 0-byte state.db (a known failure) or one moved aside for repair: the routing index
    comes back from sessions.json, and every lane's messages are stored again."""
    home = tmp_path / "home"
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    store = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    entries = [store.get_or_create_session(telegram_dm(str(n))) for n in range(3)]
    store.append_to_transcript(entries[0].session_id, {"role": "user", "content": "before"})
    store.close()
    database = home / "state.db"
    for sidecar in (home / "state.db-wal", home / "state.db-shm"):
        sidecar.unlink(missing_ok=True)
    if damage == "truncated":
        database.write_bytes(b"")
    else:
        database.rename(home / "state.db.broken")
    again = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    for entry in entries:
        assert again.peek_session_id(entry.session_key) == entry.session_id
        again.append_to_transcript(entry.session_id, {"role": "user", "content": "after"})
        assert [m["content"] for m in again.load_transcript(entry.session_id)] == ["after"]
    again.close()


def test_torn_mirror_is_reported_and_kept(
    open_store: Opener, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mirror = tmp_path / "home" / "sessions" / "sessions.json"
    key = "agent:main:telegram:dm:7"
    _legacy_mirror(mirror, {key: _legacy_entry(key, "20260101_000000_aaaaaaaa")})
    torn = mirror.read_bytes()[:120]
    mirror.write_bytes(torn)
    with caplog.at_level(logging.WARNING):
        store = open_store()
    assert store.lookup_by_session_key(key) is None
    assert str(mirror) in caplog.text
    assert mirror.read_bytes() == torn


# -- observers and files ---------------------------------------------------------------------------


def test_observers_see_committed_lifecycle_events(open_store: Opener) -> None:
    store = open_store()
    recorder = LifecycleRecorder()
    store.plugins.register(recorder, name="recorder")
    entry = store.get_or_create_session(telegram_dm())
    token = store.mark_turn_active(entry.session_key)
    assert token is not None
    store.clear_turn_active(entry.session_key, token)
    store.mark_resume_pending(entry.session_key)
    store.clear_resume_pending(entry.session_key)
    store.suspend_session(entry.session_key)
    store.get_or_create_session(telegram_dm())
    store.reset_session(entry.session_key)
    assert recorder.kinds == [
        "session_created", "turn_started", "turn_ended", "resume_marked", "resume_cleared",
        "session_suspended", "session_replaced", "session_created", "session_reset",
        "session_created",
    ]  # fmt: skip


def test_state_files_are_private(open_store: Opener, backend: str) -> None:
    if backend != "sqlite":
        pytest.skip("the SQLite files are what this checks")
    store = open_store()
    store.get_or_create_session(telegram_dm())
    home = store.config.hermes_home
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.sessions_dir).st_mode) == 0o700
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        if (home / name).exists():
            assert stat.S_IMODE(os.stat(home / name).st_mode) == 0o600, name


def test_restart_counts_live_where_the_backend_says(open_store: Opener, backend: str) -> None:
    store = open_store(gateway={"instance_id": "instance-a"})
    counts = store._counts.open()
    counts.save({"agent:main:telegram:dm:1": 1, "agent:main:telegram:dm:2": 2})
    counts.remove("agent:main:telegram:dm:1")
    assert counts.load() == {"agent:main:telegram:dm:2": 2}
    counts_file = store.config.hermes_home / "restart_counts.json"
    if backend == "sqlite":
        assert counts_file.exists()
        return
    assert not counts_file.exists()  # PostgreSQL: a table shared by the instances
    store.close()  # one writer per database: the instances take turns
    other_store = open_store(gateway={"instance_id": "instance-b"})
    other_store._counts.open().save({"agent:main:telegram:dm:3": 1})
    other_store.close()
    again = open_store(gateway={"instance_id": "instance-a"})
    again._counts.open().save({})  # "all others" means only this instance's rows
    assert again._counts.open().load() == {}
    again.close()
    other = open_store(gateway={"instance_id": "instance-b"})._counts.open()
    assert other.load() == {"agent:main:telegram:dm:3": 1}


def test_prepared_statements_bind_by_position_in_statement_order() -> None:
    """SQLite's parameters are a tuple in the order of the statement's placeholders, for one
    placeholder or many; defaults fill what is not given, a missing value is a KeyError."""
    dialect = sqlite.dialect(paramstyle="qmark")
    single = Prepared(
        delete(queued_events).where(queued_events.c.id == bindparam("event_id")), dialect
    )
    assert single.bind({"event_id": 7}) == (7,)
    many = Prepared(
        update(messages).where(messages.c.session_id == bindparam("sid")).values(active=0), dialect
    )
    assert many.bind({"sid": "s"}) == (0, "s")
    with pytest.raises(KeyError, match="sid"):
        many.bind({"active": 1})


@pytest.mark.parametrize("instances", ["single", "shared"])
def test_each_scheme_of_the_sql_store_opens_the_dialect_its_spec_declares(
    tmp_path: Path, instances: str
) -> None:
    """A URL of every scheme the built-in specs claim finds the dialect of the spec's name,
    whose flags agree with what the spec declares to the core."""
    environ = {"HERMES_HOME": str(tmp_path)}
    config = GatewayConfig.from_dict({"storage": {"instances": instances}}, environ=environ)
    for spec in sql_store.hermes_register_stores(config):
        for scheme in spec.schemes:
            dialect = dialect_for(f"{scheme}://user@host/state")
            assert dialect.name == spec.name
            assert dialect.parallel_writers == spec.parallel_writers
            assert dialect.shared_instances or spec.single_instance
    assert dialect_for("sqlite").name == "sqlite"  # a SQLAlchemy dialect's name
    with pytest.raises(StoreUnavailableError, match="knows no database 'mysql'"):
        dialect_for("mysql+pymysql://host/db")


# -- a writer batch reads its cold lanes' routes at once ---------------------------------------


def _one_batch(store: SessionStore, steps: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
    """Run ``steps`` (lane, function) as one batch of the store's one writer thread: each is
    handed over while the writer runs a step that waits until all of them are queued."""
    queued = store._writer._queues[0]
    started, release = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait()

    with ThreadPoolExecutor(len(steps) + 1) as pool:
        blocker = pool.submit(store.run, block, lane=steps[0][0])
        started.wait()  # the writer runs the blocker, its batch taken already
        futures = []
        for lane, step in steps:
            futures.append(pool.submit(store.run, step, lane=lane))
            while queued.qsize() < len(futures):
                time.sleep(0.001)
        release.set()
        blocker.result()
        return [future.result() for future in futures]


def _counting_route_reads(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The backend's route reads from now on: ``("one", key)`` and ``("many", keys)``."""
    backend, reads = store._backing.backend, list[Any]()
    one, many = backend.get_route, backend.get_routes  # type: ignore[attr-defined]

    def get_route(key: str) -> Any:
        reads.append(("one", key))
        return one(key)

    def get_routes(keys: list[str]) -> Any:
        reads.append(("many", sorted(keys)))
        return many(keys)

    monkeypatch.setattr(backend, "get_route", get_route)
    monkeypatch.setattr(backend, "get_routes", get_routes)
    return reads


def test_a_batch_reads_its_cold_lanes_routes_in_one_read(
    open_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lanes a new process has not cached, new lanes and a lane whose route names an ended
    session, begun in one batch: one read of all their routes, none of them one by one, and
    each step finds what it would have found alone."""
    first = open_store()
    known = [first.get_or_create_session(telegram_dm(str(user))) for user in range(8)]
    first.close()
    stale = known[7]
    sql(first, "UPDATE sessions SET ended_at = 5, end_reason = 'session_reset' WHERE id = :s",
        s=stale.session_id)  # fmt: skip
    store = open_store(storage={"url": first.config.storage_url, "writer_connections": 1})
    reads = _counting_route_reads(store, monkeypatch)
    sources = [telegram_dm(str(user)) for user in range(10)]
    keys = [store.session_key_for(source) for source in sources]
    steps: list[tuple[str, Callable[[], Any]]] = [
        (key, functools.partial(store.get_or_create_session, source))
        for key, source in zip(keys, sources, strict=True)
    ]
    steps.append((keys[9], functools.partial(store.get_or_create_session, sources[9])))  # again
    lanes = _one_batch(store, steps)
    assert reads == [("many", [keys[0]]), ("many", sorted(keys[1:]))]  # the blocker's batch too
    assert [lane.session_id for lane in lanes[:7]] == [entry.session_id for entry in known[:7]]
    assert lanes[7].session_id != stale.session_id  # its route was stale: a new session
    assert lanes[10].session_id == lanes[9].session_id  # created once, found by the next step
    store.close()
    again = open_store(storage={"url": first.config.storage_url})
    for lane in lanes:
        assert again.peek_session_id(lane.session_key) == lane.session_id


def test_a_batch_of_cached_lanes_reads_no_route(
    open_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(storage={"writer_connections": 1})
    sources = [telegram_dm(str(user)) for user in range(4)]
    lanes = [store.get_or_create_session(source) for source in sources]
    reads = _counting_route_reads(store, monkeypatch)
    steps: list[tuple[str, Callable[[], Any]]] = [
        (lane.session_key, functools.partial(store.get_or_create_session, source))
        for lane, source in zip(lanes, sources, strict=True)
    ]
    assert [lane.session_id for lane in _one_batch(store, steps)] == [
        lane.session_id for lane in lanes
    ]
    assert reads == []
