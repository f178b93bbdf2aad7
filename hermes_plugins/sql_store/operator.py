"""What the operator commands need of the SQL store beyond the gateway's own operations:
database checks for ``doctor``, the table copy of ``migrate`` (batches keyed by primary key,
so an interrupted copy resumes where it stopped) and reviving dead-lettered events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Float, Table, bindparam, func, or_, select, tuple_, update

from hermes_core.store.operator import Held, RecordKinds, TableDigest
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.dialects.sqlite_fts import WATERMARK
from hermes_plugins.sql_store.schema import (
    metadata,
    queued_events,
    session_turn_leases,
    sessions,
    state_meta,
)
from hermes_plugins.sql_store.search import STALE
from hermes_plugins.sql_store.statements import Prepared, _picker

TRANSFER_TABLES = (
    "state_meta", "sessions", "messages", "gateway_routing", "delivery_obligations",
    "queued_events", "seen_messages", "session_turn_leases", "restart_failure_counts",
)  # fmt: skip
"""Every table of stored state, in an order that inserts a row after the rows it points at
(``schema_version`` is the target's own)."""
RECORD_KINDS = RecordKinds(
    transfer=TRANSFER_TABLES,
    export=("sessions", "messages", "gateway_routing", "queued_events", "delivery_obligations"),
    sessions="sessions",
    routes="gateway_routing",
)
_INDEX_META = (STALE, WATERMARK)
"""``state_meta`` records of the full-text index: derived, never copied or compared."""
_RECOUNTED = ("message_count", "last_activity_at")
"""Session columns a session copied by an interrupted run may have moved in since (the gateway
appended to it); a resumed run sets them again."""


def _table(name: str) -> Table:
    if name not in TRANSFER_TABLES:
        raise KeyError(name)
    return metadata.tables[name]


def _normal(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (changed in place) in the form both dialects agree on: its float columns' values
    as floats (SQLite may return an integral one as an int)."""
    for name in _FLOATS[table.name]:
        value = row[name]
        if isinstance(value, int):
            row[name] = float(value)
    return row


_FLOATS = {
    name: tuple(column.name for column in table.columns if isinstance(column.type, Float))
    for name, table in metadata.tables.items()
}
"""Each table's float columns."""
_COMPARED = {
    name: tuple(
        column.name
        for column in table.columns
        if not (table is sessions and column.name in _RECOUNTED)
    )
    for name, table in metadata.tables.items()
}
"""Each table's columns as :meth:`OperatorRows.held_rows` compares a copied row: all but the
session columns a resumed copy sets again."""
DIGEST_ROWS = 2000
"""Rows per read of :meth:`OperatorRows.table_digest`."""


def _key_walk(
    table: Table, query: Any, after: Sequence[Any] | None, upto: Sequence[Any] | None
) -> Any:
    """``query`` over ``table`` in primary-key order, its keys after ``after`` and at most
    ``upto`` (each None: unbounded), the full-text index's own ``state_meta`` records left
    out (each database derives them: they are not stored state)."""
    key = tuple(table.primary_key.columns)
    query = query.order_by(*key)
    if table is state_meta:
        query = query.where(*(state_meta.c.key != name for name in _INDEX_META))
    if after is not None:
        query = query.where(tuple_(*key) > tuple_(*after))
    if upto is not None:
        query = query.where(tuple_(*key) <= tuple_(*upto))
    return query


class OperatorRows:
    """Checks, transfer and dead-letter revival (each write is one transaction)."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn
        self._inserts: dict[str, Prepared] = {}
        """Per table, the insert that skips a row whose primary key is there."""

    def record_kinds(self) -> RecordKinds:
        """The tables, by what the operator commands do with them."""
        return RECORD_KINDS

    # -- checks ---------------------------------------------------------------------------------

    def integrity_problems(self) -> list[str]:
        """The database's integrity and foreign-key findings (SQLite's ``integrity_check``
        and ``foreign_key_check``; none on PostgreSQL, whose server keeps its own pages
        consistent)."""
        return self._conn.dialect.integrity_problems(self._conn)

    def lease_rows(self, session_key: str | None = None) -> list[tuple[str, str, float]]:
        """Turn leases (session key, owner instance, expiry), by key."""
        table = session_turn_leases
        query = select(table.c.session_key, table.c.owner_instance, table.c.expires_at)
        if session_key is not None:
            query = query.where(table.c.session_key == session_key)
        with self._conn.read("reading turn leases") as conn:
            rows = conn.execute(query.order_by(table.c.session_key)).all()
        return [(str(key), str(owner), float(expires)) for key, owner, expires in rows]

    def obligation_counts(self) -> dict[str, int]:
        """Ledger rows per state."""
        table = metadata.tables["delivery_obligations"]
        query = select(table.c.state, func.count()).group_by(table.c.state)
        with self._conn.read("counting ledger rows") as conn:
            return {str(state): int(count) for state, count in conn.execute(query).all()}

    # -- dead letters ---------------------------------------------------------------------------

    def revive_queued(self, event_ids: Sequence[int]) -> int:
        """Put dead-lettered events back in their lane's queue with no failed attempts."""
        table = queued_events
        revived = 0
        with self._conn.write("requeueing dead letters") as cursor:
            for event_id in event_ids:
                statement = (
                    update(table)
                    .where(table.c.id == event_id, table.c.dead_at.is_not(None))
                    .values(dead_at=None, attempts=0, last_error=None)
                )
                revived += self._conn.execute(cursor, statement).rowcount
        return revived

    # -- transfer -------------------------------------------------------------------------------

    def table_rows(
        self,
        name: str,
        after: Sequence[Any] | None,
        limit: int,
        upto: Sequence[Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` rows of a table in primary-key order, after the key ``after`` (and
        at most ``upto``); the full-text index's own records in ``state_meta`` are not stored
        state (each database derives them) and are left out."""
        table = _table(name)
        query = _key_walk(table, select(table), after, upto).limit(limit)
        return self._conn.rows(self._conn.prepare(query), f"reading {name}")

    def span_end(self, name: str, after: Sequence[Any] | None, size: int) -> tuple[Any, ...] | None:
        """The primary key ``size`` rows after ``after`` in the order of :meth:`table_rows`,
        read from the key's index (``OFFSET``), or None when fewer follow."""
        table = _table(name)
        key = tuple(table.primary_key.columns)
        query = _key_walk(table, select(*key), after, None).offset(size - 1).limit(1)
        with self._conn.read(f"reading {name}") as conn:
            found = conn.execute(query).first()
        return None if found is None else tuple(found)

    def count_records(self, name: str) -> int:
        """How many rows :meth:`table_rows` yields in all."""
        table = _table(name)
        query = select(func.count()).select_from(table)
        if table is state_meta:
            query = query.where(state_meta.c.key.not_in(_INDEX_META))
        with self._conn.read(f"counting {name}") as conn:
            return int(conn.execute(query).scalar_one())

    def primary_key(self, name: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The primary key of a row of the table."""
        return tuple(row[column.name] for column in _table(name).primary_key.columns)

    def insert_missing(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the rows whose primary key the table lacks, in one transaction and one
        ``executemany`` (``ON CONFLICT (key) DO NOTHING``: a batch copied before is skipped
        by the database, so copying it again is harmless); how many were inserted. The
        transaction opens and closes with the dialect's ``copy_begin`` and ``copy_end``, so
        the message-count trigger leaves the copied sessions' counts as they came."""
        if not rows:
            return 0
        statement = self._inserts.get(name)
        if statement is None:
            table = _table(name)
            skipping = self._conn.dialect.insert(table).on_conflict_do_nothing(
                index_elements=list(table.primary_key.columns)
            )
            statement = self._inserts[name] = self._conn.prepare(skipping)
        dialect = self._conn.dialect
        with self._conn.write(f"copying {name}") as cursor:
            for opening in dialect.copy_begin:
                cursor.execute(opening)
            inserted = int(statement.run_many(cursor, rows).rowcount)
            for closing in dialect.copy_end:
                cursor.execute(closing)
        return inserted

    def held_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Held:
        """How this table holds ``rows`` (another store's rows of table ``name``), read by
        their keys and compared as tuples of :data:`_COMPARED` (an integral float equals its
        int, as SQLite may return one): all ``same`` when they are part of a copy of this
        store."""
        if not rows:
            return Held(0, 0)
        table = _table(name)
        key = tuple(table.primary_key.columns)
        key_of = _picker(tuple(column.name for column in key))
        compared = _picker(_COMPARED[name])
        keys = [key_of(row) for row in rows]
        query = select(table).where(tuple_(*key).in_(keys))
        with self._conn.read(f"reading {name}") as conn:
            found = cast("list[Mapping[str, Any]]", conn.execute(query).mappings().all())
        mine = {key_of(row): compared(row) for row in found}
        same = sum(mine.get(k) == compared(row) for k, row in zip(keys, rows, strict=True))
        return Held(same, len(mine) - same)

    def set_session_counts(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Give sessions the message counts and last activity of ``rows`` (the copy's source),
        writing only the rows that differ."""
        column = sessions.c
        statement = self._conn.prepare(
            update(sessions)
            .where(
                column.id == bindparam("row_id"),
                or_(*(column[name].is_distinct_from(bindparam(name)) for name in _RECOUNTED)),
            )
            .values({name: bindparam(name) for name in _RECOUNTED})
        )
        params = [{"row_id": row["id"], **{name: row[name] for name in _RECOUNTED}}
                  for row in rows]  # fmt: skip
        with self._conn.write("restoring session counts") as cursor:
            statement.run_many(cursor, params)

    def finish_transfer(self) -> None:
        """After a copy: the dialect's statements that make the database ready (PostgreSQL's
        id sequences moved past the copied ids; SQLite needs nothing, its index is rebuilt
        next)."""
        statements = self._conn.dialect.after_copy
        if not statements:
            return
        with self._conn.write("finishing the copy") as cursor:
            for statement in statements:
                cursor.execute(statement)

    def table_digest(self, name: str) -> TableDigest:
        """Row count and SHA-256 of a table's rows (primary-key order, the ``repr`` of each
        batch of :func:`_normal` rows: both stores read the same batches when they agree)."""
        table = _table(name)
        digest = hashlib.sha256()
        count = 0
        after: Sequence[Any] | None = None
        while rows := self.table_rows(name, after, DIGEST_ROWS):
            digest.update(repr([_normal(table, row) for row in rows]).encode())
            count += len(rows)
            after = self.primary_key(name, rows[-1])
        return TableDigest(count, digest.hexdigest())
