"""Re-keying in SQL: every table that names a session key, streamed in batches and moved in
batches."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from sqlalchemy import RowMapping, Select, delete, exists, select, update
from sqlalchemy.sql.schema import Table

from hermes_core.store.backend import KeyMoves, StoredKeys
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import ROUTE_READ, route_entry
from hermes_plugins.sql_store.schema import (
    delivery_obligations,
    gateway_routing,
    queued_events,
    restart_failure_counts,
    seen_messages,
    session_turn_leases,
    sessions,
)

_ONE_ROW_PER_KEY = (restart_failure_counts, session_turn_leases)

READ_BATCH = 1000
"""Rows fetched at a time by the reads of a re-key, and keys looked up at a time."""


class RekeyRows:
    """What ``SessionStore.rekey`` needs from the SQL store."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def set_meta(self, name: str, value: str) -> None:
        """Set one ``state_meta`` value."""
        with self._conn.write("writing state_meta") as cursor:
            self._conn.put_meta(cursor, name, value)

    def stored_keys(self) -> StoredKeys:
        """Routes, session rows and queued events, each streamed :data:`READ_BATCH` rows at a
        time, and lookups of routed keys and of the other tables' keys."""
        table, queue = sessions.c, queued_events.c
        routes = (
            {**route_entry(row), "session_key": row["session_key"]}
            for row in self._stream(
                select(*ROUTE_READ, gateway_routing.c.session_key), "reading the routing index"
            )
        )
        session_rows = (
            (row["id"], row["session_key"], row["origin_json"], float(row["started_at"]))
            for row in self._stream(
                select(table.id, table.session_key, table.origin_json, table.started_at),
                "reading the session rows",
            )
        )
        queued = (
            (int(row["id"]), row["session_key"], row["event_json"])
            for row in self._stream(
                select(queue.id, queue.session_key, queue.event_json), "reading the queue"
            )
        )
        return StoredKeys(routes, session_rows, queued, self._routed, self._others)

    def _stream(self, query: Select[Any], what: str) -> Iterator[RowMapping]:
        """The rows of ``query``, fetched :data:`READ_BATCH` at a time (a server-side cursor on
        PostgreSQL) from one read."""
        with self._conn.read(what) as conn:
            yield from conn.execution_options(yield_per=READ_BATCH).execute(query).mappings()

    def _among(self, tables: Sequence[Table], keys: Collection[str], what: str) -> set[str]:
        """Those of ``keys`` that some row of ``tables`` names, asked :data:`READ_BATCH` at a
        time."""
        wanted = sorted(keys)
        found: set[str] = set()
        with self._conn.read(what) as conn:
            for start in range(0, len(wanted), READ_BATCH):
                chunk = wanted[start : start + READ_BATCH]
                for table in tables:
                    column = table.c.session_key
                    query = select(column).where(column.in_(chunk)).distinct()
                    found.update(conn.execute(query).scalars())
        return found

    def _routed(self, keys: Collection[str]) -> set[str]:
        return self._among((gateway_routing,), keys, "reading the routing index")

    def _others(self, keys: Collection[str]) -> set[str]:
        tables = (seen_messages, delivery_obligations, *_ONE_ROW_PER_KEY)
        return self._among(tables, keys, "reading the stored session keys")

    def move_keys(self, moves: KeyMoves) -> None:
        """Apply one batch of a re-key in one transaction."""
        routing = gateway_routing.c
        with self._conn.write("re-keying session lanes") as cursor:
            for old, new in moves.lanes.items():
                found = self._conn.execute(
                    cursor, select(routing.entry_json).where(routing.session_key == old)
                ).fetchone()
                if found is not None:
                    entry = json.loads(found[0])
                    entry["session_key"] = new
                    text = json.dumps(entry, ensure_ascii=False)
                    self._conn.execute(cursor, update(gateway_routing).where(
                        routing.session_key == old
                    ).values(session_key=new, entry_json=text))  # fmt: skip
                self._move_seen(cursor, old, new)
                self._conn.execute(cursor, update(delivery_obligations).where(
                    delivery_obligations.c.session_key == old
                ).values(session_key=new))  # fmt: skip
                for table in _ONE_ROW_PER_KEY:
                    self._move_unique(cursor, table, old, new)
            for session_id, new in moves.sessions:
                self._conn.execute(cursor, update(sessions).where(
                    sessions.c.id == session_id
                ).values(session_key=new))  # fmt: skip
            for event_id, new in moves.queued:
                self._conn.execute(cursor, update(queued_events).where(
                    queued_events.c.id == event_id
                ).values(session_key=new))  # fmt: skip
            self._conn.put_meta(cursor, "key_schema", moves.key_schema)

    def _move_seen(self, cursor: Any, old: str, new: str) -> None:
        """Move a lane's redelivery records; one already recorded under ``new`` stays."""
        seen = seen_messages.alias("present")
        taken = exists().where(
            seen.c.session_key == new, seen.c.message_id == seen_messages.c.message_id
        )
        self._conn.execute(cursor, update(seen_messages).where(
            seen_messages.c.session_key == old, ~taken
        ).values(session_key=new))  # fmt: skip
        self._conn.execute(cursor, delete(seen_messages).where(seen_messages.c.session_key == old))

    def _move_unique(self, cursor: Any, table: Table, old: str, new: str) -> None:
        """Move the one row of ``old`` in a table keyed by session key, unless ``new`` has one."""
        present = self._conn.execute(
            cursor, select(table.c.session_key).where(table.c.session_key == new)
        ).fetchone()
        if present is None:
            self._conn.execute(
                cursor,
                update(table).where(table.c.session_key == old).values(session_key=new),
            )
        else:
            self._conn.execute(cursor, delete(table).where(table.c.session_key == old))
