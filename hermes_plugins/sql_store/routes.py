"""The routing index in the SQL store: one row per lane (its entry, turn marker and revision),
a turn's start, pruning, the sessions.json import, and the checked routing writes of a shared
store (each applies only at the revision this process last read)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from sqlalchemy import func, literal_column, select, true

from hermes_core.domain.errors import LeaseLostError, shown
from hermes_core.domain.models import SessionEntry
from hermes_core.store.backend import SESSION_ENDED, EntryDict, Message, SessionRow
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.dialects import postgresql_turns
from hermes_plugins.sql_store.queue import QueueRows
from hermes_plugins.sql_store.rows import (
    ROUTE_READ,
    marker_params,
    message_row,
    route_entry,
    route_params,
    session_values,
)
from hermes_plugins.sql_store.schema import RESUME_MARKED, TURN_MARKED, gateway_routing
from hermes_plugins.sql_store.statements import Prepared, idle_route
from hermes_plugins.sql_store.transcripts import TranscriptRows

logger = logging.getLogger(__name__)


ROUTE_BATCH = 1000
"""Rows fetched at a time by a streamed read of the routing index."""


def _ended_entry(row: Mapping[str, Any]) -> dict[str, Any]:
    """A route read with its session's end (:data:`SESSION_ENDED`; NULL: no session row, so
    not ended) as the entry mapping the store takes."""
    entry = route_entry(row)
    entry[SESSION_ENDED] = bool(row[SESSION_ENDED])
    return entry


class RoutingRows:
    """Routing rows; each write is one transaction. A turn's start dequeues through ``queue``
    and stores the user's message through ``transcripts``."""

    def __init__(self, conn: SqlConnection, queue: QueueRows, transcripts: TranscriptRows) -> None:
        self._conn = conn
        self._sql = conn.sql
        self._one_round_trip = conn.dialect.one_round_trip
        self._queue = queue
        self._transcripts = transcripts
        self._checks = threading.local()
        """Per thread: the routing revisions its writes expect (:meth:`checked_routes`)."""

    # -- checked writes ---------------------------------------------------------------------------

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

    def route_write(self, params: dict[str, Any]) -> tuple[Prepared, dict[str, Any], int | None]:
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

    def route_written(self, key: str, revision: int | None, applied: bool) -> bool:
        """After a routing write: whether it applied (an unchecked one always does); a checked
        one that did moves the key's row to ``revision`` in :meth:`checked_routes`."""
        if revision is None:
            return True
        if applied:
            self._checks.routes[1][key] = revision
        return applied

    def write_route(self, cursor: Any, params: dict[str, Any]) -> bool:
        """Write one routing row (see :meth:`route_write`) on the writer's cursor; False,
        nothing written, when a checked write found the row at another revision (the
        statement leaves the transaction usable)."""
        statement, values, revision = self.route_write(params)
        applied = statement.run(cursor, values).rowcount == 1
        return self.route_written(params["session_key"], revision, applied)

    # -- reads ------------------------------------------------------------------------------------

    def _routes(self, where: Any, what: str, *, limit: int | None = None) -> list[EntryDict]:
        query = select(*ROUTE_READ).where(where).order_by(gateway_routing.c.session_key)
        with self._conn.read(what) as conn:
            rows = conn.execute(query if limit is None else query.limit(limit)).mappings().all()
        return [route_entry(row) for row in rows]

    def get_route(self, session_key: str) -> EntryDict | None:
        """The stored entry of a key, or None."""
        found = self.read_route(session_key)
        return None if found is None else found[0]

    def read_route(self, session_key: str) -> tuple[EntryDict, int] | None:
        """The stored entry of a key, with whether its session ended (:data:`SESSION_ENDED`,
        from the same statement), and its row's revision; or None."""
        params = {"session_key": session_key}
        row = self._conn.row(self._sql.select_route, params, "reading a route")
        return None if row is None else (_ended_entry(row), int(row["revision"]))

    def get_routes(self, session_keys: Collection[str]) -> dict[str, EntryDict]:
        """The stored entries of ``session_keys`` by key, each with :data:`SESSION_ENDED` (see
        :meth:`read_route`); read :data:`ROUTE_BATCH` keys per statement."""
        keys, found = list(session_keys), dict[str, EntryDict]()
        for start in range(0, len(keys), ROUTE_BATCH):
            chunk = keys[start : start + ROUTE_BATCH]
            statement, slots = self._sql.select_routes(len(chunk))
            params = {f"k{index}": chunk[min(index, len(chunk) - 1)] for index in range(slots)}
            for row in self._conn.all_rows(statement, params, "reading routes"):
                found[row["session_key"]] = _ended_entry(row)
        return found

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        """The entry whose current session id is ``session_id``, or None."""
        where = gateway_routing.c.session_id == session_id
        found = self._routes(where, "reading a routing entry", limit=1)
        return found[0] if found else None

    def iter_routes(self) -> Iterator[EntryDict]:
        """Every routing entry, from one consistent read, in Python's string order of keys;
        streamed :data:`ROUTE_BATCH` rows at a time (a server-side cursor on PostgreSQL), so
        the caller holds as many entries as it keeps."""
        key = self._conn.dialect.code_point_order(gateway_routing.c.session_key)
        query = select(*ROUTE_READ).order_by(key)
        with self._conn.read("reading the routing index") as conn:
            rows = conn.execution_options(yield_per=ROUTE_BATCH).execute(query)
            for row in rows.mappings():
                yield route_entry(row)

    def route_page(self, after: str | None, limit: int) -> list[EntryDict]:
        """Up to ``limit`` entries in key order after the key ``after`` (from the first when
        None)."""
        where = true() if after is None else gateway_routing.c.session_key > after
        return self._routes(where, "reading the routing index", limit=limit)

    def routes_with_markers(self) -> list[EntryDict]:
        """Every entry whose turn marker is set, read through the partial index of those
        lanes (:data:`TURN_MARKED`)."""
        return self._routes(literal_column(TURN_MARKED), "reading turn markers")

    def routes_to_resume(self) -> list[EntryDict]:
        """Every entry marked ``resume_pending`` (the column, not the entry's JSON), read
        through the partial index of those lanes (:data:`RESUME_MARKED`)."""
        return self._routes(literal_column(RESUME_MARKED), "reading lanes to resume")

    def count_routes(self) -> int:
        """The number of routing rows."""
        with self._conn.read("counting the routing index") as conn:
            return int(conn.execute(select(func.count()).select_from(gateway_routing)).scalar_one())

    def has_routes(self) -> bool:
        """Whether any routing row exists."""
        with self._conn.read("reading the routing index") as conn:
            return conn.execute(select(gateway_routing.c.session_key).limit(1)).first() is not None

    def prune_candidates(
        self, cutoff: float, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Keys idle since before ``cutoff`` that are not suspended and have no marker, in key
        order: those after ``after`` (a page of a walk), at most ``limit`` of them."""
        key = gateway_routing.c.session_key
        query = select(key).where(idle_route(cutoff)).order_by(key).limit(limit)
        if after is not None:
            query = query.where(key > after)
        with self._conn.read("finding stale routing entries") as conn:
            return list(conn.execute(query).scalars())

    # -- writes -----------------------------------------------------------------------------------

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Upsert one routing row (revision + 1)."""
        params = route_params(entry)
        with self._conn.write("writing a routing entry") as cursor:
            self.write_route(cursor, params)

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        """Upsert several routing rows in one transaction."""
        params = [route_params(entry) for entry in entries]
        with self._conn.write("writing routing entries") as cursor:
            for values in params:
                self.write_route(cursor, values)

    def clear_turn_marker(self, entry: SessionEntry, token: str, *, rewrite: bool = False) -> bool:
        """Clear the lane's marker (``entry`` has it cleared) iff the stored marker is still
        ``token`` (compare-and-swap); only the marker's columns are written (and ``entry_json``
        with ``rewrite``)."""
        params = marker_params(entry, rewrite=rewrite) | {"token": token}
        with self._conn.write("clearing a turn marker") as cursor:
            return bool(self._sql.clear_marker.run(cursor, params).rowcount == 1)

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> bool:
        """Redelivery row, marker (and ``entry_json`` with ``rewrite``), queue dequeue and the
        user message in one transaction; False (nothing written) when ``seen``, the platform
        message id, was seen on the lane. ``lease`` (a shared store's): raises
        ``LeaseLostError``, nothing written, unless that token holds the lane's lease (fenced
        in the same statement)."""
        marker = marker_params(entry, rewrite=rewrite)
        message = message_row(*user_message) if user_message is not None else None
        key = entry.session_key

        with self._conn.write("starting a turn") as cursor:
            if self._one_round_trip:
                params = marker | postgresql_turns.message_params(message) | {
                    "seen": seen, "seen_at": time.time(), "event_id": consumed_event_id,
                    "lease": lease,
                }  # fmt: skip
                statement = postgresql_turns.BEGIN_TURN
                went, marked, held = cursor.execute(statement, params).fetchone()
                if not held:
                    raise LeaseLostError("the lane's lease is held under another token")
                if not went:
                    return False
            else:
                if seen is not None and not self._queue.mark_seen(cursor, key, seen):
                    return False
                marked = self._sql.set_marker.run(cursor, marker).rowcount
                if consumed_event_id is not None:
                    self._sql.delete_queued.run(cursor, {"event_id": consumed_event_id})
                if message is not None:
                    self._transcripts.insert(cursor, message)
            if marked != 1:  # no routing row yet: write the whole entry
                self._sql.upsert_route.run(cursor, route_params(entry.to_dict()))
        return True

    def delete_idle_routes(self, session_keys: Sequence[str], cutoff: float) -> list[str]:
        """Remove the rows of those keys still idle since before ``cutoff`` (unsuspended,
        without a marker), in one transaction; the keys removed."""
        if not session_keys:
            return []
        statement, removed = self._sql.prune_route, []
        with self._conn.write("pruning routing entries") as cursor:
            for key in session_keys:
                if statement.run(cursor, {"session_key": key, "cutoff": cutoff}).rowcount:
                    removed.append(key)
        return removed

    def import_routes(
        self, entries: Sequence[tuple[EntryDict, SessionRow]], marker: tuple[str, str]
    ) -> int:
        """Insert the entries whose key is missing, each with its session row unless one of
        that id exists, and record ``marker``, in one transaction. A session belongs to one
        lane: an entry whose session (or parent) is another lane's, or whose session another
        entry of the batch names too, is skipped with a warning (its parent dropped), so one
        chat never reads another's history."""
        query = select(gateway_routing.c.session_key, gateway_routing.c.session_id)
        with self._conn.read("reading the routing index") as conn:
            routed: dict[str, str] = {key: session_id for key, session_id in conn.execute(query)}  # noqa: C416
        named = Counter(row.id for _, row in entries)
        missing = [(entry, row) for entry, row in entries if entry["session_key"] not in routed]
        owners = {session_id: key for key, session_id in routed.items()}
        imported = 0
        with self._conn.write("importing routing entries") as cursor:
            for entry, row in missing:
                key = entry["session_key"]
                owner = owners.get(row.id) or self._session_owner(cursor, row.id)
                if named[row.id] > 1 or owner not in (None, key):
                    logger.warning(
                        "sessions.json: skipping entry %s: its session %s belongs to %s",
                        shown(key), shown(row.id),
                        "several entries" if named[row.id] > 1 else f"lane {shown(owner)}",
                    )  # fmt: skip
                    continue
                if owner is None:
                    parent = row.parent_session_id
                    if parent is not None and self._session_owner(cursor, parent) != key:
                        parent = None
                    values = session_values(replace(row, parent_session_id=parent))
                    self._sql.insert_session.run(cursor, values)
                self._sql.upsert_route.run(cursor, route_params(entry))
                imported += 1
            self._conn.put_meta(cursor, *marker)
        return imported

    def _session_owner(self, cursor: Any, session_id: str) -> str | None:
        """The lane of the session row of that id, if one exists (read on the writer's open
        transaction)."""
        result = self._sql.select_session.run(cursor, {"session_id": session_id})
        found = result.fetchone()
        if found is None:
            return None
        return str(found[[column[0] for column in result.description].index("session_key")])
