"""The SQL backend: SQLAlchemy Core over SQLite (default) or PostgreSQL.

Routing rows, transcripts and search; session rows (with the routing writes that go with them)
live in ``session_rows``, the connections and schema in ``connection``, the delivery ledger in
``ledger``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import (
    select,
    true,
)
from sqlalchemy.exc import SQLAlchemyError

from hermes_core.domain.errors import LeaseLostError, shown
from hermes_core.domain.models import SessionEntry
from hermes_core.store.backend import (
    SESSION_ENDED,
    EntryDict,
    Message,
    SearchHit,
    SessionRow,
)
from hermes_plugins.sql_store import postgres, search
from hermes_plugins.sql_store.leases import LeaseRows
from hermes_plugins.sql_store.operator import OperatorRows
from hermes_plugins.sql_store.postgres import message_params
from hermes_plugins.sql_store.rekey import RekeyRows
from hermes_plugins.sql_store.rows import (
    ROUTE_READ,
    marker_params,
    message_dict,
    message_row,
    route_entry,
    route_params,
    session_values,
)
from hermes_plugins.sql_store.schema import (
    gateway_routing,
    messages,
)
from hermes_plugins.sql_store.session_rows import SessionRows
from hermes_plugins.sql_store.statements import idle_route
from hermes_plugins.sql_store.wakeups import WakeupRows

logger = logging.getLogger(__name__)


class SqlBackend(RekeyRows, OperatorRows, LeaseRows, WakeupRows, SessionRows):
    """The canonical store over SQLite or PostgreSQL: the required contract and every
    capability (which ones a dialect offers is declared by its ``StoreSpec``)."""

    # -- routing index --------------------------------------------------------------------------

    def _routes(self, where: Any, what: str, *, limit: int | None = None) -> list[EntryDict]:
        query = select(*ROUTE_READ).where(where).order_by(gateway_routing.c.session_key)
        with self._read(what) as conn:
            rows = conn.execute(query if limit is None else query.limit(limit)).mappings().all()
        return [route_entry(row) for row in rows]

    def get_route(self, session_key: str) -> EntryDict | None:
        """The stored entry of a key, or None."""
        found = self.read_route(session_key)
        return None if found is None else found[0]

    def read_route(self, session_key: str) -> tuple[EntryDict, int] | None:
        """The stored entry of a key, with whether its session ended (:data:`SESSION_ENDED`,
        from the same statement), and its row's revision; or None."""
        row = self._row(self._sql.select_route, {"session_key": session_key}, "reading a route")
        if row is None:
            return None
        entry = route_entry(row)
        entry[SESSION_ENDED] = bool(row[SESSION_ENDED])  # NULL: no session row, not ended
        return entry, int(row["revision"])

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        """The entry whose current session id is ``session_id``, or None."""
        where = gateway_routing.c.session_id == session_id
        found = self._routes(where, "reading a routing entry", limit=1)
        return found[0] if found else None

    def iter_routes(self) -> Iterator[EntryDict]:
        """Every routing entry, from one consistent read."""
        return iter(self._routes(true(), "reading the routing index"))

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Upsert one routing row (revision + 1)."""
        params = route_params(entry)
        with self._write("writing a routing entry") as cursor:
            self._write_route(cursor, params)

    def clear_turn_marker(self, entry: SessionEntry, token: str) -> bool:
        """Clear the lane's marker (``entry`` has it cleared) iff the stored marker is still
        ``token`` (compare-and-swap); only the marker's columns are written."""
        params = marker_params(entry) | {"token": token}
        with self._write("clearing a turn marker") as cursor:
            return bool(self._sql.clear_marker.run(cursor, params).rowcount == 1)

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        lease: str | None = None,
    ) -> bool:
        """Redelivery row, marker, queue dequeue and the user message in one transaction;
        False (nothing written) when ``seen``, the platform message id, was seen on the lane.
        ``lease`` (PostgreSQL; SQLite has no leases): raises ``LeaseLostError``, nothing
        written, unless that token holds the lane's lease (fenced in the same statement)."""
        marker = marker_params(entry)
        message = message_row(*user_message) if user_message is not None else None
        key = entry.session_key

        with self._write("starting a turn") as cursor:
            if self.name == "postgresql":  # one round trip (see ``postgres``)
                params = marker | message_params(message) | {
                    "seen": seen, "seen_at": time.time(), "event_id": consumed_event_id,
                    "lease": lease,
                }  # fmt: skip
                went, marked, held = cursor.execute(postgres.BEGIN_TURN, params).fetchone()
                if not held:
                    raise LeaseLostError("the lane's lease is held under another token")
                if not went:
                    return False
            else:
                if seen is not None and not self._mark_seen(cursor, key, seen):
                    return False
                marked = self._sql.set_marker.run(cursor, marker).rowcount
                if consumed_event_id is not None:
                    self._sql.delete_queued.run(cursor, {"event_id": consumed_event_id})
                if message is not None:
                    self._insert_message(cursor, message)
            if marked != 1:  # no routing row yet: write the whole entry
                self._sql.upsert_route.run(cursor, route_params(entry.to_dict()))
        return True

    def delete_idle_routes(self, session_keys: Sequence[str], cutoff: float) -> list[str]:
        """Remove the rows of those keys still idle since before ``cutoff`` (unsuspended,
        without a marker), in one transaction; the keys removed."""
        if not session_keys:
            return []
        statement, removed = self._sql.prune_route, []
        with self._write("pruning routing entries") as cursor:
            for key in session_keys:
                if statement.run(cursor, {"session_key": key, "cutoff": cutoff}).rowcount:
                    removed.append(key)
        return removed

    def routes_with_markers(self) -> list[EntryDict]:
        """Every entry whose turn marker is set."""
        where = gateway_routing.c.active_turn_token.is_not(None)
        return self._routes(where, "reading turn markers")

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        """Upsert several routing rows in one transaction."""
        params = [route_params(entry) for entry in entries]
        with self._write("writing routing entries") as cursor:
            for values in params:
                self._write_route(cursor, values)

    def has_routes(self) -> bool:
        """Whether any routing row exists."""
        with self._read("reading the routing index") as conn:
            return conn.execute(select(gateway_routing.c.session_key).limit(1)).first() is not None

    def import_routes(
        self, entries: Sequence[tuple[EntryDict, SessionRow]], marker: tuple[str, str]
    ) -> int:
        """Insert the entries whose key is missing, each with its session row unless one of
        that id exists, and record ``marker``, in one transaction. A session belongs to one
        lane: an entry whose session (or parent) is another lane's, or whose session another
        entry of the batch names too, is skipped with a warning (its parent dropped), so one
        chat never reads another's history."""
        query = select(gateway_routing.c.session_key, gateway_routing.c.session_id)
        with self._read("reading the routing index") as conn:
            routed: dict[str, str] = {key: session_id for key, session_id in conn.execute(query)}  # noqa: C416
        named = Counter(row.id for _, row in entries)
        missing = [(entry, row) for entry, row in entries if entry["session_key"] not in routed]
        owners = {session_id: key for key, session_id in routed.items()}
        imported = 0
        with self._write("importing routing entries") as cursor:
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
            self._set_meta(cursor, *marker)
        return imported

    def _session_owner(self, cursor: Any, session_id: str) -> str | None:
        """The lane of the session row of that id, if one exists (read on the writer's open
        transaction)."""
        result = self._sql.select_session.run(cursor, {"session_id": session_id})
        found = result.fetchone()
        if found is None:
            return None
        return str(found[[column[0] for column in result.description].index("session_key")])

    def prune_candidates(self, cutoff: float) -> list[str]:
        """Keys idle since before ``cutoff`` that are not suspended and have no marker, in key
        order."""
        query = (
            select(gateway_routing.c.session_key)
            .where(idle_route(cutoff))
            .order_by(gateway_routing.c.session_key)
        )
        with self._read("finding stale routing entries") as conn:
            return list(conn.execute(query).scalars())

    # -- transcripts ----------------------------------------------------------------------------

    def append_message(self, session_id: str, message: Message) -> int:
        """Insert one message; returns its id."""
        row = message_row(session_id, message)

        with self._write("appending a message") as cursor:
            return self._insert_message(cursor, row)

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages of a session in insertion order."""
        query = (
            select(messages)
            .where(messages.c.session_id == session_id, messages.c.active == 1)
            .order_by(messages.c.id)
        )
        with self._read("loading a transcript") as conn:
            return [message_dict(dict(row)) for row in conn.execute(query).mappings()]

    def rewrite_messages(self, session_id: str, new_messages: Sequence[Message]) -> int:
        """Deactivate the active messages and append ``new_messages``, in one transaction."""
        rows = [message_row(session_id, message) for message in new_messages]

        with self._write("rewriting a transcript") as cursor:
            self._sql.deactivate_messages.run(cursor, {"session_id": session_id})
            self._sql.set_message_count.run(cursor, {"session_id": session_id, "message_count": 0})
            for row in rows:
                self._insert_message(cursor, row)
        return len(rows)

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        """Deactivate messages of the session; never deletes rows."""
        if not message_ids:
            return 0
        count = 0
        with self._write("deleting messages") as cursor:
            for message_id in message_ids:
                params = {"session_id": session_id, "message_id": message_id}
                count += self._sql.deactivate_message.run(cursor, params).rowcount
            self._sql.uncount_messages.run(cursor, {"session_id": session_id, "removed": count})
        return count

    def search(
        self, query: str, *, session_id: str | None, session_key: str | None, limit: int
    ) -> list[SearchHit]:
        """Full-text search; a failing index (or a stale one) degrades to a scan."""
        with self._read("searching transcripts") as conn:
            if self._fts == "ok":
                try:
                    return search.indexed(conn, self.name, query, session_id, session_key, limit)
                except SQLAlchemyError as exc:
                    # Only a write marks the index stale (it can tell the index's faults from
                    # its own); this query is answered by a scan.
                    conn.rollback()
                    logger.warning(
                        "%s: a full-text search failed (%s); answering it by scan",
                        self.display, self._translate(exc, "searching"),
                    )  # fmt: skip
            elif not self._warned_fts:
                self._warned_fts = True
                logger.warning("%s: full-text index %s; searching by scan", self.display, self._fts)
            return search.scan(conn, query, session_id, session_key, limit)

    # -- JSONL backlog replay -------------------------------------------------------------------

    def import_backlog(
        self,
        session_id: str,
        new_messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        """Create the session row if needed, append messages, store the offset: one transaction."""
        rows = [message_row(session_id, message) for message in new_messages]

        with self._write("replaying the JSONL backlog") as cursor:
            if create_row is not None:
                self._sql.insert_session.run(cursor, session_values(create_row))
            for row in rows:
                self._insert_message(cursor, row)
            self._set_meta(cursor, *offset)
