"""Bulk import of whole lanes (see :mod:`hermes_core.store.bulk`): a batch of lanes is one
transaction of three multi-row inserts (sessions, messages, routing entries), where the turn
path and the backlog replay write a transaction per message or per file.

The message-count trigger still counts every message into its session row, and SQLite's
full-text index catches up with the batch right after its commit (in transactions of its own,
as after any commit) until it holds every message again: a search right after an import is
answered by the index, not by a scan of what it trails.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import bindparam, select

from hermes_core.store.bulk import ImportCounts, ImportedLane
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import message_row, route_params, session_values
from hermes_plugins.sql_store.schema import gateway_routing, messages, sessions
from hermes_plugins.sql_store.statements import MESSAGE_INSERT_COLUMNS

LOOKUP_VALUES = 10_000
"""Values bound in one lookup at most (SQLite allows 32,766 by default)."""


def _chunks(values: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(values), LOOKUP_VALUES):
        yield values[start : start + LOOKUP_VALUES]


class BulkRows:
    """The bulk write of lanes; each call is one transaction."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn
        self._insert_message = conn.prepare(  # no RETURNING: the ids are not needed here
            messages.insert().values({name: bindparam(name) for name in MESSAGE_INSERT_COLUMNS})
        )

    def _present(self, column: Any, values: Sequence[str], what: str) -> dict[str, Any]:
        """The rows of ``column``'s table whose ``column`` is one of ``values``: value -> the
        row's second selected column."""
        table = column.table
        other = table.c.session_key if table is sessions else table.c.session_id
        found: dict[str, Any] = {}
        with self._conn.read(what) as conn:
            for chunk in _chunks(values):
                query = select(column, other).where(column.in_(chunk))
                found.update({value: other for value, other in conn.execute(query)})  # noqa: C416
        return found

    def import_lanes(self, lanes: Sequence[ImportedLane]) -> ImportCounts:
        """Write the lanes whose key is not routed and whose session does not exist, in one
        transaction; a parent session is kept only when it is an existing one of the lane."""
        keys = [lane.entry["session_key"] for lane in lanes]
        routed = self._present(gateway_routing.c.session_key, keys, "reading the routing table")
        ids = {lane.session.id for lane in lanes}
        ids |= {lane.session.parent_session_id for lane in lanes} - {None}  # type: ignore[arg-type]
        owners = self._present(sessions.c.id, sorted(ids), "reading session rows")
        fresh = [
            lane
            for lane in lanes
            if lane.entry["session_key"] not in routed and lane.session.id not in owners
        ]
        counts = ImportCounts(skipped=len(lanes) - len(fresh))
        if not fresh:
            return counts
        sql = self._conn.sql
        session_rows, message_rows, route_rows = [], [], []
        for lane in fresh:
            key, row = lane.entry["session_key"], lane.session
            if row.parent_session_id is not None and owners.get(row.parent_session_id) != key:
                row = replace(row, parent_session_id=None)
            session_rows.append(sql.insert_session.bind(session_values(row)))
            message_rows += [
                self._insert_message.bind(message_row(row.id, message)) for message in lane.messages
            ]
            route_rows.append(sql.insert_route.bind(route_params(lane.entry)))
        with self._conn.write("importing lanes") as cursor:
            cursor.executemany(sql.insert_session.sql, session_rows)
            if message_rows:
                cursor.executemany(self._insert_message.sql, message_rows)
            cursor.executemany(sql.insert_route.sql, route_rows)
            if not self._conn.dialect.returning_ids:  # the index follows ids it was told of
                newest = cursor.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()
                self._conn.index.inserted(int(newest[0]))
        while self._conn.index.index_backlog():
            pass
        counts.lanes, counts.messages = len(fresh), len(message_rows)
        return counts
