"""Session rows of the SQL backend, with the routing-row writes that go with them: a new or
reopened session and its routing row are one transaction, and on a shared store the routing
write is checked against the revision this process last read (see
``RoutingRows.checked_routes``)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select

from hermes_core.domain.errors import DuplicateSessionIdError, StoreError
from hermes_core.store.backend import CounterDelta, EntryDict, SessionRow
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.dialects import postgresql_turns
from hermes_plugins.sql_store.routes import RoutingRows
from hermes_plugins.sql_store.rows import route_params, session_row, session_values
from hermes_plugins.sql_store.schema import sessions
from hermes_plugins.sql_store.statements import Prepared


class SessionRows:
    """Session rows, each write with its lane's routing row (written through ``routing``)."""

    def __init__(self, conn: SqlConnection, routing: RoutingRows) -> None:
        self._conn = conn
        self._sql = conn.sql
        self._one_round_trip = conn.dialect.one_round_trip
        self._routing = routing

    def _session(self, statement: Prepared, params: dict[str, Any]) -> SessionRow | None:
        """A session row (see ``SqlConnection.row``)."""
        row = self._conn.row(statement, params, "reading a session")
        return None if row is None else session_row(row)

    def get_session(self, session_id: str) -> SessionRow | None:
        """One session row, or None."""
        return self._session(self._sql.select_session, {"session_id": session_id})

    def newest_session(self, session_key: str) -> SessionRow | None:
        """The most recently started session of a key."""
        return self._session(self._sql.newest_session, {"session_key": session_key})

    def count_sessions(self) -> int:
        """Session rows, counted up to 2 (all ``has_any_sessions`` needs)."""
        query = select(func.count()).select_from(select(sessions.c.id).limit(2).subquery())
        with self._conn.read("counting sessions") as conn:
            return int(conn.execute(query).scalar() or 0)

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        """End the predecessor, insert the row and write the routing entry, in one transaction."""
        route = route_params(entry)
        try:
            with self._conn.write("creating a session") as cursor:
                if self._one_round_trip:
                    self._create_session_at_once(cursor, route, row, end_previous)
                    return
                if not self._routing.write_route(cursor, route):
                    return  # checked, and the row changed: nothing is written
                if end_previous is not None:
                    ending = {"session_id": end_previous[0], "end_reason": end_previous[1]}
                    self._sql.end_session.run(cursor, ending | {"ended_at": time.time()})
                self._sql.insert_session.run(cursor, session_values(row))
        except StoreError as exc:
            problem = str(exc.__cause__).lower()
            if "sessions" in problem and ("unique" in problem or "duplicate" in problem):
                raise DuplicateSessionIdError(f"session id {row.id} already exists") from exc
            raise

    def _create_session_at_once(
        self,
        cursor: Any,
        route: dict[str, Any],
        row: SessionRow,
        end_previous: tuple[str, str] | None,
    ) -> None:
        """:meth:`create_session` in one round trip: the routing write, the predecessor's end
        and the session row as one statement (``postgresql_turns.create_session``)."""
        statement, values, revision = self._routing.route_write(route)
        end_id, end_reason = end_previous if end_previous is not None else (None, None)
        params = statement.bind(values) | {
            "e_id": end_id, "e_reason": end_reason, "e_at": time.time(),
        }  # fmt: skip
        params.update({f"s_{name}": value for name, value in session_values(row).items()})
        at_once = postgresql_turns.create_session(statement.sql)
        written = cursor.execute(at_once, params).fetchone()[0]
        self._routing.route_written(route["session_key"], revision, written == 1)

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        """Clear the row's end and write the routing entry, in one transaction."""
        route = route_params(entry)
        with self._conn.write("reopening a session") as cursor:
            if self._routing.write_route(cursor, route):
                self._sql.reopen_session.run(cursor, {"session_id": session_id})

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        """Write the entry and add ``delta`` to the session row, in one transaction."""
        route = route_params(entry)
        params = {name: getattr(delta, name) for name in CounterDelta.__dataclass_fields__}
        params["session_id"] = session_id
        with self._conn.write("updating session counters") as cursor:
            if self._routing.write_route(cursor, route):
                self._sql.add_counters.run(cursor, params)
