"""What the operator commands need of the SQL store beyond the gateway's own operations:
database checks for ``doctor``, the table copy of ``migrate`` (batches keyed by primary key,
so an interrupted copy resumes where it stopped) and reviving dead-lettered events.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Table, bindparam, func, insert, select, tuple_, update

from hermes_core.domain.errors import StoreError, shown
from hermes_core.store.operator import TRANSFER_TABLES, TableDigest
from hermes_plugins.sql_store.exclusive import LOCK_SUFFIX
from hermes_plugins.sql_store.queue import QueueRows
from hermes_plugins.sql_store.rows import ROUTE_READ, json_object, route_problems
from hermes_plugins.sql_store.schema import (
    FTS_WATERMARK,
    gateway_routing,
    metadata,
    queued_events,
    session_turn_leases,
    sessions,
    state_meta,
)
from hermes_plugins.sql_store.statements import Prepared

_FTS_PROBE = "SELECT rowid FROM messages_fts WHERE messages_fts MATCH '\"hermesprobe\"' LIMIT 1"
_INDEX_META = ("fts_stale", FTS_WATERMARK)
"""``state_meta`` records of the full-text index: derived, never copied or compared."""
_FTS_COVERAGE = (
    "SELECT (SELECT count(*) FROM messages_fts_docsize), (SELECT count(*) FROM messages WHERE "
    f"id <= (SELECT CAST(value AS INTEGER) FROM state_meta WHERE key = '{FTS_WATERMARK}'))"
)
_PG_PROBE = "SELECT id FROM messages WHERE search_tsv @@ plainto_tsquery('simple', 'hermesprobe')"
_SEQUENCES = ("messages", "queued_events")
_RECOUNTED = ("message_count", "last_activity_at")
"""Session columns the message-count trigger moves while messages are copied; set afterwards."""


def _table(name: str) -> Table:
    if name not in TRANSFER_TABLES:
        raise KeyError(name)
    return metadata.tables[name]


def _canonical(table: Table, row: Mapping[str, Any], *, copied: bool = False) -> str:
    """A row in the form both dialects agree on: canonical JSON, floats by their exact repr.
    ``copied``: without the session columns a copy sets only at its end."""
    values = {
        column: repr(float(value)) if isinstance(value, float) else value
        for column, value in row.items()
        if not (copied and table is sessions and column in _RECOUNTED)
    }
    return json.dumps(values, sort_keys=True)


class OperatorRows(QueueRows):
    """Checks, transfer and dead-letter revival (each write is one transaction)."""

    # -- checks ---------------------------------------------------------------------------------

    def integrity_problems(self) -> list[str]:
        """SQLite ``integrity_check`` and ``foreign_key_check`` findings (none on PostgreSQL,
        whose server keeps its own pages consistent)."""
        if self.name != "sqlite":
            return []
        with self._read("checking the database's integrity") as conn:
            found = [str(row[0]) for row in conn.exec_driver_sql("PRAGMA integrity_check")]
            keys = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
        problems = [line for line in found if line != "ok"]
        problems += [f"{row[0]} row {row[1]} points at a missing {row[2]} row" for row in keys]
        return problems

    def fts_problems(self) -> list[str]:
        """The full-text index's own integrity check and a real MATCH probe; ``[]`` when
        healthy or when full-text search is unavailable."""
        if self._fts == "unavailable":
            return []
        if self.name != "sqlite":
            try:
                with self._read("probing the search index") as conn:
                    conn.exec_driver_sql(_PG_PROBE).all()
            except StoreError as exc:  # any failure is the finding
                return [f"the search index cannot be queried: {exc}"]
            return []
        # A connection of its own: the check is an INSERT command that writes nothing, which
        # the store's read-only connections refuse; it runs in a transaction rolled back.
        raw = sqlite3.connect(self.path, timeout=5)
        problems = []
        try:
            for what, sql in (
                # rank 0: the index's own structure (it holds the messages up to its
                # watermark only, so it is not compared with the whole table here)
                ("integrity-check", "INSERT INTO messages_fts(messages_fts, rank) "
                                    "VALUES ('integrity-check', 0)"),
                ("MATCH probe", _FTS_PROBE),
                ("watermark", _FTS_COVERAGE),
            ):  # fmt: skip
                try:
                    rows = raw.execute(sql).fetchall()
                except sqlite3.DatabaseError as exc:
                    problems.append(f"{what}: {exc}")
                    continue
                if what == "watermark" and rows and rows[0][0] != rows[0][1]:
                    problems.append(
                        f"the index holds {rows[0][0]} messages, but {rows[0][1]} are at or "
                        "below its watermark"
                    )
            raw.rollback()
        finally:
            raw.close()
        return problems

    def writer_lock_path(self) -> str | None:
        """The SQLite writer lock file (None on PostgreSQL, whose lock lives on the server)."""
        return f"{self.path}{LOCK_SUFFIX}" if self.name == "sqlite" else None

    def unreadable_rows(self) -> list[str]:
        """Rows the store passes over, one line each: routing rows with a junk ``entry_json``
        or time column (``ls``, ``show``, ``rekey`` and the gateway skip the lane or keep the
        entry's own time), queued events whose ``event_json`` is not a JSON object (never
        dispatched; ``show`` lists a dead letter's as null)."""
        routes = select(gateway_routing.c.session_key, *ROUTE_READ).order_by(
            gateway_routing.c.session_key
        )
        events = select(queued_events.c.id, queued_events.c.session_key,
                        queued_events.c.event_json).order_by(queued_events.c.id)  # fmt: skip
        with self._read("checking stored rows") as conn:
            found = [
                f"routing row {shown(row['session_key'])}: {'; '.join(problems)}"
                for row in conn.execute(routes).mappings()
                if (problems := route_problems(row))
            ]
            found += [
                f"queued event #{event_id} of {shown(key)}: its event_json is not a JSON object"
                for event_id, key, text in conn.execute(events)
                if json_object(text) is None
            ]
        return found

    def routing_problems(self) -> list[str]:
        """Routing rows whose session row is missing or ended."""
        query = (
            "SELECT r.session_key, r.session_id, s.id, s.ended_at FROM gateway_routing r "
            "LEFT JOIN sessions s ON s.id = r.session_id ORDER BY r.session_key"
        )
        with self._read("checking the routing table") as conn:
            rows = conn.exec_driver_sql(query).all()
        problems = []
        for key, session_id, found, ended in rows:
            if found is None:
                problems.append(f"{key} points at session {session_id}, which does not exist")
            elif ended is not None:
                problems.append(f"{key} points at session {session_id}, which has ended")
        return problems

    def lease_rows(self, session_key: str | None = None) -> list[tuple[str, str, float]]:
        """Turn leases (session key, owner instance, expiry), by key."""
        table = session_turn_leases
        query = select(table.c.session_key, table.c.owner_instance, table.c.expires_at)
        if session_key is not None:
            query = query.where(table.c.session_key == session_key)
        with self._read("reading turn leases") as conn:
            rows = conn.execute(query.order_by(table.c.session_key)).all()
        return [(str(key), str(owner), float(expires)) for key, owner, expires in rows]

    def obligation_counts(self) -> dict[str, int]:
        """Ledger rows per state."""
        table = metadata.tables["delivery_obligations"]
        query = select(table.c.state, func.count()).group_by(table.c.state)
        with self._read("counting ledger rows") as conn:
            return {str(state): int(count) for state, count in conn.execute(query).all()}

    # -- dead letters ---------------------------------------------------------------------------

    def revive_queued(self, event_ids: Sequence[int]) -> int:
        """Put dead-lettered events back in their lane's queue with no failed attempts."""
        table = queued_events
        revived = 0
        with self._write("requeueing dead letters") as cursor:
            for event_id in event_ids:
                statement = (
                    update(table)
                    .where(table.c.id == event_id, table.c.dead_at.is_not(None))
                    .values(dead_at=None, attempts=0, last_error=None)
                )
                revived += self._execute(cursor, statement).rowcount
        return revived

    # -- transfer -------------------------------------------------------------------------------

    def table_rows(
        self, name: str, after: Sequence[Any] | None, limit: int
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` rows of a table in primary-key order, after the key ``after``; the
        full-text index's own records in ``state_meta`` are not stored state (each database
        derives them) and are left out."""
        table = _table(name)
        key = tuple(table.primary_key.columns)
        query = select(table).order_by(*key).limit(limit)
        if table is state_meta:
            query = query.where(state_meta.c.key.not_in(_INDEX_META))
        if after is not None:
            query = query.where(tuple_(*key) > tuple_(*after))
        with self._read(f"reading {name}") as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    def primary_key(self, name: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The primary key of a row of the table."""
        return tuple(row[column.name] for column in _table(name).primary_key.columns)

    def insert_missing(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the rows whose primary key the table lacks, in one transaction; how many."""
        if not rows:
            return 0
        table = _table(name)
        columns = tuple(table.primary_key.columns)
        keys = [self.primary_key(name, row) for row in rows]
        present_query = select(*columns).where(tuple_(*columns).in_(keys))
        statement = Prepared(insert(table), self._dialect)
        with self._read(f"reading {name}") as conn:
            present = {tuple(row) for row in conn.execute(present_query).all()}
        missing = [row for row, key in zip(rows, keys, strict=True) if key not in present]
        with self._write(f"copying {name}") as cursor:
            for row in missing:
                statement.run(cursor, row)
        return len(missing)

    def foreign_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """How many of ``rows`` (another store's rows of table ``name``) this table lacks or
        holds with other values, the session columns a copy sets at its end aside: 0 when
        they are part of a copy of this store."""
        if not rows:
            return 0
        table = _table(name)
        keys = [self.primary_key(name, row) for row in rows]
        query = select(table).where(tuple_(*table.primary_key.columns).in_(keys))
        with self._read(f"reading {name}") as conn:
            found = [dict(row) for row in conn.execute(query).mappings()]
        mine = {self.primary_key(name, row): _canonical(table, row, copied=True) for row in found}
        return sum(
            mine.get(key) != _canonical(table, row, copied=True)
            for key, row in zip(keys, rows, strict=True)
        )

    def set_session_counts(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Give sessions the message counts and last activity of ``rows`` (the copy's source),
        which the message-count trigger changed while their messages were inserted."""
        statement = Prepared(
            update(sessions)
            .where(sessions.c.id == bindparam("row_id"))
            .values({column: bindparam(column) for column in _RECOUNTED}),
            self._dialect,
        )
        with self._write("restoring session counts") as cursor:
            for row in rows:
                values = {column: row[column] for column in _RECOUNTED}
                statement.run(cursor, {"row_id": row["id"], **values})

    def finish_transfer(self) -> None:
        """After a copy: move PostgreSQL's id sequences past the copied ids (SQLite needs
        nothing; its index is rebuilt next)."""
        if self.name == "sqlite":
            return
        with self._write("finishing the copy") as cursor:
            for name in _SEQUENCES:
                cursor.execute(
                    f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                    f"coalesce((SELECT max(id) FROM {name}), 0) + 1, false)"
                )

    def table_digest(self, name: str) -> TableDigest:
        """Row count and SHA-256 of a table's rows (primary-key order, canonical JSON)."""
        digest = hashlib.sha256()
        count = 0
        after: Sequence[Any] | None = None
        while rows := self.table_rows(name, after, 1000):
            for row in rows:
                digest.update(_canonical(_table(name), row).encode("utf-8") + b"\n")
            count += len(rows)
            after = self.primary_key(name, rows[-1])
        return TableDigest(count, digest.hexdigest())
