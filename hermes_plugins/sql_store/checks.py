"""What ``doctor`` reads of the SQL store's rows: the routing table a page at a time (each row
checked for junk and for a missing or ended session in the same statement), and the queued
events whose JSON the store cannot read. Memory is bounded by a page, whatever the store's size.
"""

from __future__ import annotations

from sqlalchemy import select, true

from hermes_core.domain.errors import shown
from hermes_core.store.operator import RouteChecks
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import ROUTE_READ, json_object, route_problems
from hermes_plugins.sql_store.schema import gateway_routing, queued_events, sessions

EVENT_PAGE = 1_000
"""Queued events read at a time."""


class CheckRows:
    """Reads of the checks; each one statement on a pooled read connection."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def check_routes(self, after: str | None, limit: int) -> RouteChecks:
        """Up to ``limit`` routing rows in key order after the key ``after``, each with the
        session row it points at (left-joined), checked as :class:`RouteChecks` says."""
        route = gateway_routing.c
        query = (
            select(route.session_key, route.session_id, *ROUTE_READ, sessions.c.id.label("found"),
                   sessions.c.ended_at)
            .select_from(gateway_routing.outerjoin(sessions, sessions.c.id == route.session_id))
            .where(true() if after is None else route.session_key > after)
            .order_by(route.session_key)
            .limit(limit)
        )  # fmt: skip
        checks = RouteChecks([], [], [])
        with self._conn.read("checking the routing table") as conn:
            for row in conn.execute(query).mappings():
                key, session_id = row["session_key"], row["session_id"]
                checks.sessions.append((key, session_id))
                if problems := route_problems(row):
                    checks.unreadable.append(f"routing row {shown(key)}: {'; '.join(problems)}")
                if row["found"] is None:
                    checks.dangling.append(
                        f"{key} points at session {session_id}, which does not exist"
                    )
                elif row["ended_at"] is not None:
                    checks.dangling.append(f"{key} points at session {session_id}, which has ended")
        return checks

    def unreadable_events(self) -> list[str]:
        """Queued events whose ``event_json`` is not a JSON object (never dispatched; ``show``
        lists a dead letter's as null), one line each; the queue is read :data:`EVENT_PAGE`
        events at a time."""
        table = queued_events
        found: list[str] = []
        after = -1
        while True:
            query = (
                select(table.c.id, table.c.session_key, table.c.event_json)
                .where(table.c.id > after)
                .order_by(table.c.id)
                .limit(EVENT_PAGE)
            )
            with self._conn.read("checking queued events") as conn:
                rows = conn.execute(query).all()
            found += [
                f"queued event #{event_id} of {shown(key)}: its event_json is not a JSON object"
                for event_id, key, text in rows
                if json_object(text) is None
            ]
            if len(rows) < EVENT_PAGE:
                return found
            after = rows[-1][0]
