"""Session rows of the SQL backend, with the routing-row writes that go with them: a new or
reopened session and its routing row are one transaction, and on a shared store the routing
write is checked against the revision this process last read (see :meth:`checked_routes`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select

from hermes_core.domain.errors import DuplicateSessionIdError, StoreError
from hermes_core.store.backend import CounterDelta, EntryDict, SessionRow
from hermes_plugins.sql_store import postgres
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import route_params, session_row, session_values
from hermes_plugins.sql_store.schema import sessions
from hermes_plugins.sql_store.statements import Prepared


class SessionRows(SqlConnection):
    """Session rows and the (checked) routing-row writes of the backend."""

    @contextmanager
    def checked_routes(self, expected: Mapping[str, int | None]) -> Iterator[dict[str, int]]:
        """Within it, this thread's routing writes to a key of ``expected`` apply only at the
        revision given (None: only while the key has no row); a method whose routing write
        does not apply writes nothing. Yields the keys written with their new revisions."""
        written: dict[str, int] = {}
        self._checks.routes = (expected, written)
        try:
            yield written
        finally:
            self._checks.routes = None

    def _route_write(self, params: dict[str, Any]) -> tuple[Prepared, dict[str, Any], int | None]:
        """How to write one routing row (:func:`route_params`) now: the upsert (revision + 1),
        or within :meth:`checked_routes` the insert (no row expected) or the update at the
        expected revision; with its parameters and, for a checked write, the revision the row
        has once it applied (None: unchecked)."""
        checks = getattr(self._checks, "routes", None)
        key = params["session_key"]
        if checks is None or key not in checks[0]:
            return self._sql.upsert_route, params, None
        revision = checks[0][key]
        if revision is None:
            return self._sql.insert_route, params, params["revision"]
        return self._sql.update_route, params | {"expected": revision}, revision + 1

    def _route_written(self, key: str, revision: int | None, applied: bool) -> bool:
        """After a routing write: whether it applied (an unchecked one always does); a checked
        one that did moves the key's row to ``revision`` in :meth:`checked_routes`."""
        if revision is None:
            return True
        if applied:
            self._checks.routes[1][key] = revision
        return applied

    def _write_route(self, cursor: Any, params: dict[str, Any]) -> bool:
        """Write one routing row (see :meth:`_route_write`); False, nothing written, when a
        checked write found the row at another revision (the statement leaves the transaction
        usable)."""
        statement, values, revision = self._route_write(params)
        applied = statement.run(cursor, values).rowcount == 1
        return self._route_written(params["session_key"], revision, applied)

    def _row(self, statement: Prepared, params: dict[str, Any], what: str) -> Any:
        """One row of a read as a mapping, or None: in the writer's open batch on its cursor
        (it sees the batch's writes), else from the pool."""
        if self._in_batch:
            return self._fetch(statement, params, what)
        with self._read(what) as conn:
            return conn.exec_driver_sql(statement.sql, statement.bind(params)).mappings().first()

    def _session(self, statement: Prepared, params: dict[str, Any]) -> SessionRow | None:
        """A session row (see :meth:`_row`)."""
        row = self._row(statement, params, "reading a session")
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
        with self._read("counting sessions") as conn:
            return int(conn.execute(query).scalar() or 0)

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        """End the predecessor, insert the row and write the routing entry, in one transaction."""
        route = route_params(entry)
        try:
            with self._write("creating a session") as cursor:
                if self.name == "postgresql":  # one round trip (see ``postgres``)
                    self._create_session_at_once(cursor, route, row, end_previous)
                    return
                if not self._write_route(cursor, route):
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
        """:meth:`create_session` on PostgreSQL: the routing write, the predecessor's end and the
        session row as one statement."""
        statement, values, revision = self._route_write(route)
        end_id, end_reason = end_previous if end_previous is not None else (None, None)
        params = statement.bind(values) | {
            "e_id": end_id, "e_reason": end_reason, "e_at": time.time(),
        }  # fmt: skip
        params.update({f"s_{name}": value for name, value in session_values(row).items()})
        written = cursor.execute(postgres.create_session(statement.sql), params).fetchone()[0]
        self._route_written(route["session_key"], revision, written == 1)

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        """Clear the row's end and write the routing entry, in one transaction."""
        route = route_params(entry)
        with self._write("reopening a session") as cursor:
            if self._write_route(cursor, route):
                self._sql.reopen_session.run(cursor, {"session_id": session_id})

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        """Write the entry and add ``delta`` to the session row, in one transaction."""
        route = route_params(entry)
        params = {name: getattr(delta, name) for name in CounterDelta.__dataclass_fields__}
        params["session_id"] = session_id
        with self._write("updating session counters") as cursor:
            if self._write_route(cursor, route):
                self._sql.add_counters.run(cursor, params)
