"""The durable per-lane queue of inbound events, its dead letters and the redelivery check in
the SQL store."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select, tuple_, update

from hermes_core.store.backend import DeadLetter
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.dialects import postgresql_turns
from hermes_plugins.sql_store.schema import queued_events, seen_messages


class QueueRows:
    """Queue reads and writes; each write is one transaction. Order is the row id per key."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn
        self._sql = conn.sql
        self._one_round_trip = conn.dialect.one_round_trip

    def mark_seen(self, cursor: Any, session_key: str, message_id: str) -> bool:
        """Record a platform message as seen on the lane (on the writer's cursor); False if it
        was already."""
        params = {"session_key": session_key, "message_id": message_id, "seen_at": time.time()}
        return bool(self._sql.insert_seen.run(cursor, params).rowcount == 1)

    def add_queued(
        self, session_key: str, internal: bool, bound: str | None, event: str,
        seen: str | None = None,
    ) -> int | None:  # fmt: skip
        """Append an event to the lane's queue; returns its id, or None (nothing written) when
        ``seen``, the platform message id, was seen on the lane already."""
        now = time.time()
        params = {
            "session_key": session_key, "internal": int(internal), "bound_session_id": bound,
            "event_json": event, "enqueued_at": now, "updated_at": now,
        }  # fmt: skip
        with self._conn.write("queueing an event") as cursor:
            if self._one_round_trip:
                statement = postgresql_turns.QUEUE_EVENT
                row = cursor.execute(statement, {**params, "seen": seen}).fetchone()
                return None if row is None else int(row[0])
            if seen is not None and not self.mark_seen(cursor, session_key, seen):
                return None
            self._sql.insert_queued.run(cursor, params)
            return int(cursor.lastrowid)

    def fail_queued(self, event_id: int, error: str, max_attempts: int) -> bool:
        """Count a failed dispatch of a queued event; at ``max_attempts`` it becomes a dead
        letter (kept, never restored). True when it did."""
        table, row = queued_events, queued_events.c.id == event_id
        counted = (
            update(table).where(row).values(attempts=table.c.attempts + 1, last_error=error[:2000])
        )
        dying = (
            update(table).where(row, table.c.attempts >= max_attempts).values(dead_at=time.time())
        )
        with self._conn.write("recording a failed dispatch") as cursor:
            self._conn.execute(cursor, counted)
            return bool(self._conn.execute(cursor, dying).rowcount == 1)

    def dead_letters(self) -> list[DeadLetter]:
        """Queued events set aside after failing to start, oldest first."""
        table = queued_events
        query = select(table).where(table.c.dead_at.is_not(None)).order_by(table.c.id)
        with self._conn.read("reading dead letters") as conn:
            rows = conn.execute(query).all()
        return [
            DeadLetter(
                int(row.id),
                row.session_key,
                row.event_json,
                int(row.attempts),
                row.last_error,
                float(row.dead_at),
            )
            for row in rows
        ]

    def prune_seen(self, before: float, limit: int) -> int:
        """Forget at most ``limit`` redelivery rows older than ``before`` (epoch seconds)."""
        table = seen_messages
        doomed = select(table.c.session_key, table.c.message_id).where(table.c.seen_at < before)
        statement = delete(table).where(
            tuple_(table.c.session_key, table.c.message_id).in_(doomed.limit(limit))
        )
        with self._conn.write("pruning seen messages") as cursor:
            return int(self._conn.execute(cursor, statement).rowcount)

    def remove_queued(self, event_ids: Sequence[int]) -> int:
        """Delete queued events in one transaction."""
        removed = 0
        with self._conn.write("discarding queued events") as cursor:
            for event_id in event_ids:
                removed += self._sql.delete_queued.run(cursor, {"event_id": event_id}).rowcount
        return removed

    def queued(self, session_key: str | None = None) -> list[tuple[int, str, str]]:
        """Every queued event (or one lane's), oldest first. A lane's is read on the writer's
        connection: it sees the writer's open batch."""
        if session_key is not None:
            with self._conn.write("reading a lane's queue") as cursor:
                rows = self._sql.lane_queued.run(cursor, {"session_key": session_key}).fetchall()
            return [(int(row[0]), row[1], row[2]) for row in rows]
        table = queued_events
        query = (
            select(table.c.id, table.c.session_key, table.c.event_json)
            .where(table.c.dead_at.is_(None))
            .order_by(table.c.id)
        )
        with self._conn.read("reading the queue") as conn:
            rows = conn.execute(query).all()
        return [(int(row[0]), row[1], row[2]) for row in rows]
