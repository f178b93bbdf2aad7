"""One SQL schema for SQLite and PostgreSQL, with versioned, idempotent upgrades.

Canonical tables are SQLAlchemy Core ``Table`` objects; the full-text index is derived (SQLite
FTS5 external content over a view, PostgreSQL ``tsvector`` + GIN) and lives in dialect helpers.

One module on purpose: a table, its indexes and the upgrade steps that shaped it are read
together; split, a table would sit apart from its migrations.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    delete,
    insert,
    inspect,
    select,
    update,
)
from sqlalchemy.schema import CreateTable

metadata = MetaData()

schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))

state_meta = Table(
    "state_meta",
    metadata,
    Column("key", String, primary_key=True),
    Column("value", Text),
)

sessions = Table(
    "sessions",
    metadata,
    Column("id", String, primary_key=True),
    Column("session_key", String, nullable=False),
    Column("source", String, nullable=False),
    Column("chat_id", String),
    Column("chat_type", String),
    Column("thread_id", String),
    Column("user_id", String),
    Column("display_name", String),
    Column("origin_json", Text),
    Column("profile_name", String),
    Column("parent_session_id", String, ForeignKey("sessions.id")),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("end_reason", String),
    Column("last_activity_at", Float),
    Column("message_count", Integer, nullable=False, server_default="0"),
    Column("input_tokens", Integer, nullable=False, server_default="0"),
    Column("output_tokens", Integer, nullable=False, server_default="0"),
    Column("cache_read_tokens", Integer, nullable=False, server_default="0"),
    Column("cache_write_tokens", Integer, nullable=False, server_default="0"),
    Column("total_tokens", Integer, nullable=False, server_default="0"),
    Column("estimated_cost_usd", Float, nullable=False, server_default="0"),
    Column("cost_status", String),
    Column("expiry_finalized", Integer, nullable=False, server_default="0"),
    Index("ix_sessions_key_started", "session_key", Column("started_at").desc()),
)

messages = Table(
    "messages",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("session_id", String, ForeignKey("sessions.id"), nullable=False),
    Column("role", String, nullable=False),
    Column("content", Text),
    Column("tool_calls", Text),
    Column("tool_call_id", String),
    Column("tool_name", String),
    Column("timestamp", Float, nullable=False),
    Column("token_count", Integer),
    Column("finish_reason", String),
    Column("platform_message_id", String),
    Column("display_kind", String),
    Column("active", Integer, nullable=False, server_default="1"),
    Column("extra_json", Text),
    Index("ix_messages_session_id", "session_id", "id"),
)

gateway_routing = Table(
    "gateway_routing",
    metadata,
    Column("session_key", String, primary_key=True),
    Column("session_id", String, nullable=False),
    Column("updated_at", Float),
    Column("suspended", Integer, nullable=False, server_default="0"),
    Column("resume_pending", Integer, nullable=False, server_default="0"),
    Column("active_turn_token", String),
    Column("active_turn_started_at", Float),
    Column("revision", Integer, nullable=False, server_default="0"),
    Column("entry_json", Text, nullable=False),
    Index("ix_gateway_routing_session_id", "session_id"),
)

delivery_obligations = Table(
    "delivery_obligations",
    metadata,
    Column("obligation_id", String, primary_key=True),
    Column("session_key", String, nullable=False),
    Column("session_id", String),
    Column("platform", String, nullable=False),
    Column("chat_id", String),
    Column("thread_id", String),
    Column("reply_to_message_id", String),
    Column("content", Text, nullable=False),
    Column("origin_kind", String, nullable=False),
    Column("state", String, nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("failure_kind", String),
    Column("last_error", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("owner_instance", String),
    Column("owner_boot", String),
    Column("lease_expires_at", Float),
    Column("marked_sends", Integer, nullable=False, server_default="0"),
    sqlite_with_rowid=False,
)

queued_events = Table(
    "queued_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("session_key", String, nullable=False),
    Column("internal", Integer, nullable=False, server_default="0"),
    Column("bound_session_id", String),
    Column("event_json", Text, nullable=False),
    Column("enqueued_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", Text),
    Column("dead_at", Float),
    Index("ix_queued_events_key", "session_key", "id"),
)

seen_messages = Table(
    "seen_messages",
    metadata,
    Column("session_key", String, primary_key=True),
    Column("message_id", String, primary_key=True),
    Column("seen_at", Float, nullable=False),
    Index("ix_seen_messages_seen_at", "seen_at").ddl_if(dialect="postgresql"),
    sqlite_with_rowid=False,
)

session_turn_leases = Table(
    "session_turn_leases",
    metadata,
    Column("session_key", String, primary_key=True),
    Column("owner_instance", String, nullable=False),
    Column("owner_boot", String, nullable=False),
    Column("token", String, nullable=False),
    Column("acquired_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("waiting", Integer, nullable=False, server_default="0"),
)

restart_failure_counts = Table(
    "restart_failure_counts",
    metadata,
    Column("session_key", String, primary_key=True),
    Column("count", Integer, nullable=False),
    Column("owner_instance", String),
    Column("updated_at", Float, nullable=False),
)

CANONICAL_TABLES = ("sessions", "messages", "gateway_routing")

# -- full-text search (derived) -------------------------------------------------------------------

FTS_TRIGGERS = ("messages_fts_insert", "messages_fts_delete", "messages_fts_update")
_PROJECTION = "CASE WHEN {r}.role = 'tool' THEN substr({r}.content, 1, 8192) ELSE {r}.content END"

SQLITE_FTS_VIEW = (
    "CREATE VIEW IF NOT EXISTS messages_fts_src AS SELECT id, "
    + _PROJECTION.format(r="messages")
    + " AS content, tool_name, tool_calls FROM messages"
)
SQLITE_FTS_TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5("
    "content, tool_name, tool_calls, content='messages_fts_src', content_rowid='id')"
)
_FTS_INSERT = (
    "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls) VALUES "
    "(new.id, " + _PROJECTION.format(r="new") + ", new.tool_name, new.tool_calls);"
)
_FTS_DELETE = (
    "INSERT INTO messages_fts(messages_fts, rowid, content, tool_name, tool_calls) VALUES "
    "('delete', old.id, " + _PROJECTION.format(r="old") + ", old.tool_name, old.tool_calls);"
)
FTS_WATERMARK = "fts_indexed_through"
"""``state_meta`` key: the highest message id SQLite's full-text index holds (see ``fts.py``)."""
_INDEXED = (
    f"old.id <= (SELECT CAST(value AS INTEGER) FROM state_meta WHERE key = '{FTS_WATERMARK}')"
)
SQLITE_FTS_TRIGGERS = (
    f"CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages WHEN {_INDEXED} "
    f"BEGIN {_FTS_DELETE} END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content, tool_name, "
    "tool_calls, role ON messages WHEN (old.content IS NOT new.content OR old.tool_name IS NOT "
    "new.tool_name OR old.tool_calls IS NOT new.tool_calls OR old.role IS NOT new.role) AND "
    f"{_INDEXED} BEGIN {_FTS_DELETE} {_FTS_INSERT} END",
)
"""Index entries of rows the index already holds follow their updates and deletes; a message
insert does not touch the index (it is indexed in bulk when the watermark passes it)."""
TAIL_PROJECTION = _PROJECTION.format(r="m")
"""What the index holds of a message ``m`` (tool output cut to 8 KiB)."""
SQLITE_FTS_CATCH_UP = (
    "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls) SELECT id, "
    + _PROJECTION.format(r="messages")
    + ", tool_name, tool_calls FROM messages WHERE id > :after AND id <= :upto ORDER BY id"
)

POSTGRES_SEARCH = (
    "ALTER TABLE messages ADD COLUMN IF NOT EXISTS search_tsv tsvector GENERATED ALWAYS AS "
    "(to_tsvector('simple'::regconfig, left(coalesce(CASE WHEN role = 'tool' THEN "
    "left(content, 8192) ELSE content END, '') || ' ' || coalesce(tool_name, '') || ' ' || "
    "coalesce(tool_calls, ''), 65536))) STORED",
    "CREATE INDEX IF NOT EXISTS ix_messages_search ON messages USING gin (search_tsv)",
)


def sqlite_has_fts5(conn: Connection) -> bool:
    """Whether this SQLite build has FTS5 (a missing module means ``fts: unavailable``)."""
    options = {row[0] for row in conn.exec_driver_sql("PRAGMA compile_options")}
    return "ENABLE_FTS5" in options


SQLITE_FTS_SETUP = (
    SQLITE_FTS_VIEW,
    SQLITE_FTS_TABLE,
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
)
"""View, FTS5 table, and a rebuild that indexes the messages already stored."""


FTS_SHADOW_SUFFIXES = ("data", "idx", "docsize", "config")
_TWIN = "hermes_fts_twin"


def reset_sqlite_fts(cursor: Any) -> None:
    """Return the FTS5 index to the state of a freshly created one (on a DBAPI cursor, inside
    the caller's transaction), however damaged its shadow tables are, so ``rebuild`` can run.

    A temporary twin table provides SQLite's own empty shadow rows; the damaged index's shadow
    tables are recreated if missing, emptied and refilled from the twin. Messages are untouched.
    """
    have = {row[0] for row in cursor.execute("SELECT name FROM sqlite_master").fetchall()}
    if "messages_fts" not in have:  # the table itself is gone: clear leftovers and recreate
        for suffix in FTS_SHADOW_SUFFIXES:
            cursor.execute(f"DROP TABLE IF EXISTS messages_fts_{suffix}")
        cursor.execute(SQLITE_FTS_VIEW)
        cursor.execute(SQLITE_FTS_TABLE)
        return
    cursor.execute(SQLITE_FTS_TABLE.replace("IF NOT EXISTS messages_fts", f"temp.{_TWIN}"))
    try:
        for suffix in FTS_SHADOW_SUFFIXES:
            ddl = cursor.execute(
                "SELECT sql FROM sqlite_temp_master WHERE name = ?", (f"{_TWIN}_{suffix}",)
            ).fetchone()[0]
            cursor.execute(
                ddl.replace(
                    f"CREATE TABLE '{_TWIN}_", "CREATE TABLE IF NOT EXISTS main.'messages_fts_"
                )
            )
            cursor.execute(f"DELETE FROM main.messages_fts_{suffix}")
            cursor.execute(
                f"INSERT INTO main.messages_fts_{suffix} SELECT * FROM temp.{_TWIN}_{suffix}"
            )
    finally:
        cursor.execute(f"DROP TABLE IF EXISTS temp.{_TWIN}")


def create_sqlite_fts(conn: Connection) -> None:
    """Create the FTS5 view, table and triggers (idempotent) and index existing messages."""
    for statement in (*SQLITE_FTS_SETUP, *SQLITE_FTS_TRIGGERS):
        conn.exec_driver_sql(statement)


# -- message counts (canonical, kept by the database) -------------------------------------------

# Every stored message counts towards its session's ``message_count`` and moves its
# ``last_activity_at``: a trigger does it inside the insert, so a message costs one statement.
SQLITE_COUNT_TRIGGER = (
    "CREATE TRIGGER IF NOT EXISTS messages_count AFTER INSERT ON messages BEGIN "
    "UPDATE sessions SET message_count = message_count + 1, last_activity_at = new.timestamp "
    "WHERE id = new.session_id; END"
)
POSTGRES_COUNT_TRIGGER = (
    "CREATE OR REPLACE FUNCTION hermes_count_message() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "BEGIN UPDATE sessions SET message_count = message_count + 1, "
    "last_activity_at = NEW.timestamp WHERE id = NEW.session_id; RETURN NULL; END $$",
    "DROP TRIGGER IF EXISTS messages_count ON messages",
    "CREATE TRIGGER messages_count AFTER INSERT ON messages FOR EACH ROW "
    "EXECUTE FUNCTION hermes_count_message()",
)


# -- versions -------------------------------------------------------------------------------------


def _v1_canonical(conn: Connection) -> None:
    """Version 1: every table of the store."""
    metadata.create_all(conn)


def _v2_search(conn: Connection) -> None:
    """Version 2: the derived full-text index (skipped where SQLite lacks FTS5)."""
    if conn.dialect.name == "sqlite":
        if sqlite_has_fts5(conn):
            create_sqlite_fts(conn)
    else:
        for statement in POSTGRES_SEARCH:
            conn.exec_driver_sql(statement)


def _add_missing_columns(conn: Connection, added: dict[str, tuple[tuple[str, str], ...]]) -> None:
    """Add each ``(name, type)`` column to its table unless the table has it already (a
    database created at a later version was made with it)."""
    for table, columns in added.items():
        present = {column["name"] for column in inspect(conn).get_columns(table)}
        for name, kind in columns:
            if name not in present:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _v3_redelivery_and_dead_letters(conn: Connection) -> None:
    """Version 3: ``seen_messages`` (the durable redelivery check), the dispatch attempts of
    queued events (dead letters), the marked re-sends of ledger rows, message counts kept by a
    trigger, and a lane's turn marker and activity kept in columns (so a turn does not rewrite
    ``entry_json``). Tables and columns a database created at version 3 already has are
    skipped."""
    seen_messages.create(conn, checkfirst=True)
    _add_missing_columns(conn, {
        "queued_events": (("attempts", "INTEGER NOT NULL DEFAULT 0"), ("last_error", "TEXT"),
                          ("dead_at", "FLOAT")),
        "delivery_obligations": (("marked_sends", "INTEGER NOT NULL DEFAULT 0"),),
        "gateway_routing": (("active_turn_started_at", "FLOAT"),),
    })  # fmt: skip
    sqlite = conn.dialect.name == "sqlite"
    for statement in (SQLITE_COUNT_TRIGGER,) if sqlite else POSTGRES_COUNT_TRIGGER:
        conn.exec_driver_sql(statement)
    routing = gateway_routing.c
    markers = select(routing.session_key, routing.entry_json).where(
        routing.active_turn_token.is_not(None), routing.active_turn_started_at.is_(None)
    )
    for key, text in conn.execute(markers).all():  # a marker's start moves to its column
        started = json.loads(text).get("active_turn_started_at")
        stamp = datetime.fromisoformat(started).timestamp() if isinstance(started, str) else None
        conn.execute(
            update(gateway_routing)
            .where(routing.session_key == key)
            .values(active_turn_started_at=stamp)
        )


def _v4_index_behind_a_watermark(conn: Connection) -> None:
    """Version 4 (SQLite): the full-text index no longer follows each insert; it holds the
    messages up to ``fts_indexed_through`` and the writer indexes the rest in bulk. Every
    message stored so far is indexed (the old insert trigger did it), unless the index is stale,
    when the rebuild sets the watermark."""
    if conn.dialect.name != "sqlite" or not sqlite_has_fts5(conn):
        return
    meta = state_meta.c
    stale = conn.execute(select(meta.value).where(meta.key == "fts_stale")).first() is not None
    for trigger in FTS_TRIGGERS:
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {trigger}")
    newest = conn.exec_driver_sql("SELECT coalesce(max(id), 0) FROM messages").scalar()
    conn.execute(delete(state_meta).where(meta.key == FTS_WATERMARK))
    conn.execute(insert(state_meta).values(key=FTS_WATERMARK, value=str(newest)))
    if not stale:
        for statement in SQLITE_FTS_TRIGGERS:
            conn.exec_driver_sql(statement)


DUPLICATE_OPEN = "duplicate_open"
"""End reason given by version 5 to the older of two sessions open on one key at once."""


def _v5_shared_instances(conn: Connection) -> None:
    """Version 5: at most one open (and not expiry-fenced) session per key, enforced by a
    unique partial index (older
    duplicates, which only two writers racing on one database could make, are ended
    ``duplicate_open``); indexes for the lanes with a turn marker and for expired leases."""
    conn.exec_driver_sql(
        f"UPDATE sessions SET end_reason = '{DUPLICATE_OPEN}', ended_at = started_at "
        "WHERE end_reason IS NULL AND expiry_finalized = 0 AND EXISTS (SELECT 1 FROM sessions "
        "AS newer WHERE newer.session_key = sessions.session_key AND newer.end_reason IS NULL "
        "AND newer.expiry_finalized = 0 AND "
        "(newer.started_at > sessions.started_at OR (newer.started_at = sessions.started_at "
        "AND newer.id > sessions.id)))"
    )
    for statement in (
        "CREATE UNIQUE INDEX IF NOT EXISTS ux_sessions_open_key ON sessions (session_key) "
        "WHERE end_reason IS NULL AND expiry_finalized = 0",
        "CREATE INDEX IF NOT EXISTS ix_gateway_routing_marker ON gateway_routing "
        "(session_key) WHERE active_turn_token IS NOT NULL",
        "CREATE INDEX IF NOT EXISTS ix_session_turn_leases_expires ON session_turn_leases "
        "(expires_at)",
    ):
        conn.exec_driver_sql(statement)


def _rebuild_without_rowid(conn: Connection, table: Table) -> None:
    """Copy a SQLite ``table`` into a ``WITHOUT ROWID`` one of its current definition (rows
    and the columns it has kept, its old indexes dropped), unless it is one already."""
    ddl = conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table.name,)
    ).scalar_one()
    if "WITHOUT ROWID" in ddl.upper():
        return
    staging = table.to_metadata(MetaData(), name=f"{table.name}_v6")
    conn.execute(CreateTable(staging))
    stored = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table.name})")}
    columns = ", ".join(column.name for column in table.c if column.name in stored)
    conn.exec_driver_sql(
        f"INSERT INTO {staging.name} ({columns}) SELECT {columns} FROM {table.name}"
    )
    conn.exec_driver_sql(f"DROP TABLE {table.name}")
    conn.exec_driver_sql(f"ALTER TABLE {staging.name} RENAME TO {table.name}")


def _v6_fewer_pages_per_turn(conn: Connection) -> None:
    """Version 6: fewer b-tree pages written per turn. The ledger is scanned by state (it holds
    only outstanding rows and a bounded number of terminal ones), so its state index goes. On
    SQLite the ledger and ``seen_messages`` become ``WITHOUT ROWID`` (their text primary key is
    the table), ``seen_messages`` loses its ``seen_at`` index (the hourly prune scans) and
    ``gateway_routing`` its marker index (one process scans it once, at start-up)."""
    conn.exec_driver_sql("DROP INDEX IF EXISTS ix_delivery_obligations_state")
    if conn.dialect.name != "sqlite":
        return
    for table in (delivery_obligations, seen_messages):
        _rebuild_without_rowid(conn, table)
    for index in ("ix_seen_messages_seen_at", "ix_gateway_routing_marker"):
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index}")


def _v7_lease_waiting(conn: Connection) -> None:
    """Version 7: a lease row says when a process queued an event for the lane while another
    held it (``waiting``), so that the holder's release is one statement (see ``leases``)."""
    _add_missing_columns(
        conn, {"session_turn_leases": (("waiting", "INTEGER NOT NULL DEFAULT 0"),)}
    )


MIGRATIONS: tuple[Callable[[Connection], None], ...] = (
    _v1_canonical, _v2_search, _v3_redelivery_and_dead_letters, _v4_index_behind_a_watermark,
    _v5_shared_instances, _v6_fewer_pages_per_turn, _v7_lease_waiting,
)  # fmt: skip
"""Upgrade steps; step ``n`` brings a database from version ``n`` to ``n + 1``."""

SCHEMA_VERSION = len(MIGRATIONS)
