"""One SQL schema for SQLite and PostgreSQL, with versioned, idempotent upgrades.

Canonical tables are SQLAlchemy Core ``Table`` objects; the full-text index is derived (SQLite
FTS5 external content over a view, PostgreSQL ``tsvector`` + GIN) and is the dialects' (an
upgrade step asks the store's dialect for what differs). A table, its indexes and the upgrade
steps that shaped it are read together here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

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
    inspect,
    literal_column,
    select,
    update,
)
from sqlalchemy.schema import CreateTable

from hermes_core.store.backend import STREAM_METADATA

if TYPE_CHECKING:
    from hermes_plugins.sql_store.dialects.base import Dialect

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

RESUME_MARKED = "resume_pending != 0"
"""The condition of the partial index of the lanes marked to resume, as the query reading them
spells it too (with no parameter, the planner can prove the index covers it)."""

TURN_MARKED = "active_turn_token IS NOT NULL"
"""The condition of the partial index of the lanes with a turn marker (see
:data:`RESUME_MARKED`)."""

_MARKER_INDEX = (
    "CREATE INDEX IF NOT EXISTS ix_gateway_routing_marker ON gateway_routing "
    f"(session_key) WHERE {TURN_MARKED}"
)
"""The partial index of the lanes with a turn marker (versions 5 and 11)."""

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
    Index("ix_gateway_routing_updated", Column("updated_at").desc(), "session_key"),
    Index(
        "ix_gateway_routing_resume",
        "session_key",
        sqlite_where=literal_column(RESUME_MARKED),
        postgresql_where=literal_column(RESUME_MARKED),
    ),
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
    Column("stream_messages", Text),
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

# -- versions -------------------------------------------------------------------------------------


def _v1_canonical(conn: Connection, dialect: Dialect) -> None:
    """Version 1: every table of the store."""
    metadata.create_all(conn)


def _v2_search(conn: Connection, dialect: Dialect) -> None:
    """Version 2: the derived full-text index (skipped where SQLite lacks FTS5)."""
    dialect.create_search_index(conn)


def _add_missing_columns(conn: Connection, added: dict[str, tuple[tuple[str, str], ...]]) -> None:
    """Add each ``(name, type)`` column to its table unless the table has it already (a
    database created at a later version was made with it)."""
    for table, columns in added.items():
        present = {column["name"] for column in inspect(conn).get_columns(table)}
        for name, kind in columns:
            if name not in present:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _v3_redelivery_and_dead_letters(conn: Connection, dialect: Dialect) -> None:
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
    for statement in dialect.count_trigger:
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


def _v4_index_behind_a_watermark(conn: Connection, dialect: Dialect) -> None:
    """Version 4 (SQLite): the full-text index no longer follows each insert (see
    ``dialects/sqlite_fts.py``)."""
    dialect.index_behind_a_watermark(conn)


DUPLICATE_OPEN = "duplicate_open"
"""End reason given by version 5 to the older of two sessions open on one key at once."""


def _v5_shared_instances(conn: Connection, dialect: Dialect) -> None:
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
        _MARKER_INDEX,
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


def _v6_fewer_pages_per_turn(conn: Connection, dialect: Dialect) -> None:
    """Version 6: fewer b-tree pages written per turn. The ledger is scanned by state (it holds
    only outstanding rows and a bounded number of terminal ones), so its state index goes. On
    SQLite the ledger and ``seen_messages`` become ``WITHOUT ROWID`` (their text primary key is
    the table), ``seen_messages`` loses its ``seen_at`` index (the hourly prune scans) and
    ``gateway_routing`` its marker index (one process scans it once, at start-up)."""
    conn.exec_driver_sql("DROP INDEX IF EXISTS ix_delivery_obligations_state")
    if not dialect.without_rowid:
        return
    for table in (delivery_obligations, seen_messages):
        _rebuild_without_rowid(conn, table)
    for index in ("ix_seen_messages_seen_at", "ix_gateway_routing_marker"):
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index}")


def _v7_lease_waiting(conn: Connection, dialect: Dialect) -> None:
    """Version 7: a lease row says when a process queued an event for the lane while another
    held it (``waiting``), so that the holder's release is one statement (see ``leases``)."""
    _add_missing_columns(
        conn, {"session_turn_leases": (("waiting", "INTEGER NOT NULL DEFAULT 0"),)}
    )


def _v8_lanes_by_activity(conn: Connection, dialect: Dialect) -> None:
    """Version 8: an index of lanes by their latest activity (newest first, then by key), the
    order of ``ls``, so its first page reads that page's rows only."""
    conn.exec_driver_sql(
        "CREATE INDEX IF NOT EXISTS ix_gateway_routing_updated ON gateway_routing "
        "(updated_at DESC, session_key)"
    )


def _v9_streamed_reply_rows(conn: Connection, dialect: Dialect) -> None:
    """Version 9: a ledger row names the platform messages its streamed reply is shown in
    (``stream_messages``), which the lane's metadata held until the row settled; an owed row's
    messages move from its lane's metadata into the row."""
    _add_missing_columns(conn, {"delivery_obligations": (("stream_messages", "TEXT"),)})
    routing, ledger = gateway_routing.c, delivery_obligations.c
    owed = select(routing.session_key, routing.entry_json).where(
        routing.entry_json.like(f'%"{STREAM_METADATA}"%'),
        routing.session_key.in_(select(ledger.session_key)),
    )
    for key, text in conn.execute(owed).all():
        entry = json.loads(text)
        layout = entry.get("metadata", {}).pop(STREAM_METADATA, None)
        if not isinstance(layout, dict) or not layout.get("messages"):
            continue
        conn.execute(
            update(delivery_obligations)
            .where(ledger.session_key == key, ledger.stream_messages.is_(None))
            .values(stream_messages=json.dumps(layout))
        )
        conn.execute(
            update(gateway_routing)
            .where(routing.session_key == key)
            .values(entry_json=json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
        )


def _v10_lanes_to_resume(conn: Connection, dialect: Dialect) -> None:
    """Version 10: an index of the lanes marked ``resume_pending`` only (a partial index: no
    turn writes it), which a gateway reads at its start; without it that read scanned every
    routing row (0.6 s at a million lanes)."""
    conn.exec_driver_sql(
        "CREATE INDEX IF NOT EXISTS ix_gateway_routing_resume ON gateway_routing "
        f"(session_key) WHERE {RESUME_MARKED}"
    )


def _v11_marked_lanes_and_copied_counts(conn: Connection, dialect: Dialect) -> None:
    """Version 11: SQLite indexes the lanes with a turn marker again (a partial index, as
    PostgreSQL has since version 5), which every gateway start reads; version 6 dropped it to
    save a page per turn, and the start then scanned every routing row (1.2 s at a million
    lanes). The message-count trigger leaves the sessions alone inside a transaction of
    ``migrate``'s copy (``Dialect.copy_begin``), whose session rows come with their counts."""
    conn.exec_driver_sql(_MARKER_INDEX)
    for statement in dialect.count_trigger:
        conn.exec_driver_sql(statement)


MIGRATIONS: tuple[Callable[[Connection, Dialect], None], ...] = (
    _v1_canonical, _v2_search, _v3_redelivery_and_dead_letters, _v4_index_behind_a_watermark,
    _v5_shared_instances, _v6_fewer_pages_per_turn, _v7_lease_waiting, _v8_lanes_by_activity,
    _v9_streamed_reply_rows, _v10_lanes_to_resume, _v11_marked_lanes_and_copied_counts,
)  # fmt: skip
"""Upgrade steps; step ``n`` brings a database from version ``n`` to ``n + 1``."""

SCHEMA_VERSION = len(MIGRATIONS)
