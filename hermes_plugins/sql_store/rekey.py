"""Re-keying in SQL: every table that names a session key, read at once and moved in batches."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import delete, exists, select, update
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


class RekeyRows:
    """What ``SessionStore.rekey`` needs from the SQL store."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def set_meta(self, name: str, value: str) -> None:
        """Set one ``state_meta`` value."""
        with self._conn.write("writing state_meta") as cursor:
            self._conn.put_meta(cursor, name, value)

    def stored_keys(self) -> StoredKeys:
        """Routes, session rows, queued events and the other tables' keys, from one read."""
        table = sessions.c
        others: set[str] = set()
        with self._conn.read("reading the stored session keys") as conn:
            routes = [
                {**route_entry(row), "session_key": row["session_key"]}
                for row in conn.execute(
                    select(*ROUTE_READ, gateway_routing.c.session_key)
                ).mappings()
            ]
            rows = conn.execute(
                select(table.id, table.session_key, table.origin_json, table.started_at)
            )
            session_rows = [(row[0], row[1], row[2], float(row[3])) for row in rows]
            events = conn.execute(
                select(queued_events.c.id, queued_events.c.session_key, queued_events.c.event_json)
            )
            queued = [(int(row[0]), row[1], row[2]) for row in events]
            for other in (seen_messages, delivery_obligations, *_ONE_ROW_PER_KEY):
                others.update(conn.execute(select(other.c.session_key).distinct()).scalars())
        return StoredKeys(routes, session_rows, queued, frozenset(others))

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
