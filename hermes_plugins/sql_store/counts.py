"""Stuck-loop counts in SQL: on PostgreSQL several instances share the store,
so each row is tagged with the instance that last struck the lane."""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import delete, select

from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.schema import restart_failure_counts


class CountRows:
    """Restart-count reads and writes; each write is one transaction."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def restart_counts(self, owner: str) -> dict[str, int]:
        """The counts of the lanes this instance struck last."""
        table = restart_failure_counts
        query = select(table.c.session_key, table.c.count).where(table.c.owner_instance == owner)
        with self._conn.read("reading restart counts") as conn:
            return {str(key): int(count) for key, count in conn.execute(query)}

    def save_restart_counts(self, owner: str, counts: Mapping[str, int]) -> None:
        """Replace this instance's counts with ``counts`` (rows of other instances stay)."""
        table = restart_failure_counts
        now = time.time()
        with self._conn.write("saving restart counts") as cursor:
            self._conn.execute(cursor, delete(table).where(table.c.owner_instance == owner))
            for key, count in counts.items():
                self._conn.execute(cursor, delete(table).where(table.c.session_key == key))
                self._conn.execute(cursor, table.insert().values(
                    session_key=key, count=count, owner_instance=owner, updated_at=now,
                ))  # fmt: skip

    def remove_restart_count(self, session_key: str) -> None:
        """Forget a lane's count, whichever instance struck it."""
        table = restart_failure_counts
        with self._conn.write("removing a restart count") as cursor:
            self._conn.execute(cursor, delete(table).where(table.c.session_key == session_key))
