"""The durable per-lane queue of inbound events in the SQL store (SPEC §8.7)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import insert, select, update

from hermes_plugins.sql_store.ledger import LedgerRows
from hermes_plugins.sql_store.schema import queued_events


class QueueRows(LedgerRows):
    """Queue reads and writes; each write is one transaction. Order is the row id per key."""

    def add_queued(self, session_key: str, internal: bool, bound: str | None, event: str) -> int:
        """Append an event to the lane's queue; returns its id."""
        now = time.time()
        statement = insert(queued_events).values(
            session_key=session_key, internal=int(internal), bound_session_id=bound,
            event_json=event, enqueued_at=now, updated_at=now,
        )  # fmt: skip
        if self.name != "sqlite":
            statement = statement.returning(queued_events.c.id)
        with self._write("queueing an event") as cursor:
            self._execute(cursor, statement)
            return int(cursor.lastrowid if self.name == "sqlite" else cursor.fetchone()[0])

    def replace_queued(self, event_id: int, event: str) -> None:
        """Store a merged event in place of the queued one."""
        statement = (
            update(queued_events)
            .where(queued_events.c.id == event_id)
            .values(event_json=event, updated_at=time.time())
        )
        with self._write("merging a queued event") as cursor:
            self._execute(cursor, statement)

    def remove_queued(self, event_ids: Sequence[int]) -> int:
        """Delete queued events in one transaction."""
        removed = 0
        with self._write("discarding queued events") as cursor:
            for event_id in event_ids:
                removed += self._sql.delete_queued.run(cursor, {"event_id": event_id}).rowcount
        return removed

    def queued(self) -> list[tuple[int, str, str]]:
        """Every queued event, oldest first."""
        table = queued_events
        query = select(table.c.id, table.c.session_key, table.c.event_json).order_by(table.c.id)
        with self._read("reading the queue") as conn:
            return [(int(row.id), row.session_key, row.event_json) for row in conn.execute(query)]
