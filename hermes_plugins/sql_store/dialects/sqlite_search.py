"""SQLite's full-text index as the store uses it: FTS5 behind a watermark (see ``sqlite_fts``),
caught up by the writer after its commits, searched together with the messages past it, and
disabled (marked stale) when it fails, so that messages are still stored."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select, text

from hermes_core.domain.errors import StoreError
from hermes_plugins.sql_store.dialects import sqlite_fts
from hermes_plugins.sql_store.dialects.sqlite_fts import (
    FOLLOWING,
    TAIL_PROJECTION,
    TRIGGERS,
    WATERMARK,
    DeferredIndex,
)
from hermes_plugins.sql_store.schema import state_meta
from hermes_plugins.sql_store.search import STALE, SearchIndex

if TYPE_CHECKING:
    from hermes_plugins.sql_store.connection import SqlConnection

logger = logging.getLogger(__name__)

_PROBE = "SELECT rowid FROM messages_fts WHERE messages_fts MATCH '\"hermesprobe\"' LIMIT 1"
_COVERAGE = (
    "SELECT (SELECT count(*) FROM messages_fts_docsize), (SELECT count(*) FROM messages WHERE "
    f"id <= (SELECT CAST(value AS INTEGER) FROM state_meta WHERE key = '{WATERMARK}'))"
)


def fts5_query(query: str) -> str:
    """Every whitespace-separated token quoted (inner quotes doubled); all are required."""
    return " ".join('"' + token.replace('"', '""') + '"' for token in query.split())


class Fts5Index(SearchIndex):
    """FTS5 behind a watermark."""

    def __init__(self, store: SqlConnection, state: str, deferred: DeferredIndex | None) -> None:
        super().__init__(store, state)
        self._deferred = deferred
        """The watermark while the index is in use (None: stale or unavailable)."""

    @classmethod
    def opened(cls, store: SqlConnection, conn: Connection) -> Fts5Index:
        """The index as the database holds it: unavailable without FTS5; stale when so marked,
        or without a watermark (the rebuild sets it)."""
        if not sqlite_fts.has_fts5(conn):
            return cls(store, "unavailable", None)
        state = cls.stored_state(conn)
        if state != "ok":
            return cls(store, state, None)
        watermark = conn.execute(
            select(state_meta.c.value).where(state_meta.c.key == WATERMARK)
        ).scalar()
        if watermark is None:
            return cls(store, "stale", None)
        newest = conn.exec_driver_sql("SELECT coalesce(max(id), 0) FROM messages").scalar()
        return cls(store, "ok", DeferredIndex(int(watermark), int(newest or 0)))

    # -- following the writer ---------------------------------------------------------------------

    def inserted(self, message_id: int) -> None:
        if self._deferred is not None:
            self._deferred.inserted(message_id)

    def rolled_back(self) -> None:
        if self._deferred is not None:
            self._deferred.rolled_back()

    def after_commit(self) -> None:
        """Index the messages waiting past the watermark, when enough wait, in a transaction
        of its own; a fault of the index marks it stale (the messages are stored already)."""
        index = self._deferred
        if index is None or self.state != "ok" or not index.due:
            return
        store = self._store
        try:
            store.commit_apart(index.catch_up)
        except store.driver_error as exc:
            error = store.translate(exc, "indexing messages for search")
            try:
                self._disable(error)
            except StoreError:
                logger.exception("%s: marking the full-text index stale failed", store.display)
                self.state, self._deferred = "stale", None
            return
        index.committed()

    def _disable(self, error: StoreError) -> None:
        """Fail open: drop the index's triggers and mark it stale (its own transaction)."""
        self._deferred = None
        store = self._store
        with store.write("disabling the full-text index", ddl=True) as cursor:
            for trigger in TRIGGERS:
                cursor.execute(f"DROP TRIGGER IF EXISTS {trigger}")
            store.put_meta(cursor, STALE, "1")
        self.state = "stale"
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: the full-text index is broken (%s); messages are still stored, search uses "
                "a slower scan until the index is rebuilt",
                store.display, error,
            )  # fmt: skip

    # -- rebuilding -----------------------------------------------------------------------------

    def reindex_fts(self) -> None:
        """Nothing: :meth:`start_fts_rebuild` empties the index and the writer's batches
        refill it."""

    def _empty(self, cursor: Any) -> int:
        """The index emptied behind a watermark of 0, so that every message is indexed later
        in batches (:meth:`index_backlog`, or after the next commits) while search stays
        exact."""
        for trigger in TRIGGERS:
            cursor.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        sqlite_fts.reset(cursor)
        newest = cursor.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()[0]
        self._store.put_meta(cursor, WATERMARK, "0")
        for statement in FOLLOWING:
            cursor.execute(statement)
        return int(newest)

    def _refill(self, newest: int) -> None:
        self._deferred = DeferredIndex(0, newest)

    def index_backlog(self) -> bool:
        """Index one batch of the messages waiting past the watermark (at most
        ``sqlite_fts.CATCH_UP_MAX``, in a transaction of its own, as after any commit)."""
        if self._deferred is None:
            return False
        with self._store.writer_lock:
            self.after_commit()
        index = self._deferred
        return index is not None and self.state == "ok" and index.due

    def fts_problems(self) -> list[str]:
        """FTS5's integrity check, a real MATCH probe and the watermark's coverage."""
        if self.state == "unavailable":
            return []
        # A connection of its own: the check is an INSERT command that writes nothing, which
        # the store's read-only connections refuse; it runs in a transaction rolled back.
        raw = sqlite3.connect(self._store.url.database or "", timeout=5)
        problems = []
        try:
            for what, sql in (
                # rank 0: the index's own structure (it holds the messages up to its
                # watermark only, so it is not compared with the whole table here)
                ("integrity-check", "INSERT INTO messages_fts(messages_fts, rank) "
                                    "VALUES ('integrity-check', 0)"),
                ("MATCH probe", _PROBE),
                ("watermark", _COVERAGE),
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

    # -- search -------------------------------------------------------------------------------

    def _ranked(
        self,
        conn: Connection,
        query: str,
        session_id: str | None,
        session_key: str | None,
        limit: int,
        among: int,
    ) -> list[Any]:
        """FTS5 hits, best first, among the newest ``among`` matches in scope, ranked in a
        private in-memory FTS5 table of the same tokenizer (:func:`_rank_in_memory`) that holds
        the index's newest ``among`` matches (its doclist walked by rowid descending) and the
        messages past its watermark, or for a session or key every message of that scope."""
        match = fts5_query(query)
        scope, params = "", {"match": match, "among": among}
        if session_id is not None:
            scope += " AND m.session_id = :session_id"
            params["session_id"] = session_id
        if session_key is not None:
            scope += (
                " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = :session_key)"
            )
            params["session_key"] = session_key
        columns = (
            "m.id, m.session_id, m.role, m.timestamp, m.content, "
            f"{TAIL_PROJECTION} AS indexed, m.tool_name, m.tool_calls"
        )
        if scope:
            # A scope's own messages, every one matched in memory: their number bounds the
            # cost, where a walk of the term's doclist would pass every newer match first.
            after = 0
        else:
            # Read before the index: a catch-up committed in between makes rows show twice
            # (merged below), never not at all.
            watermark = conn.execute(
                select(state_meta.c.value).where(state_meta.c.key == WATERMARK)
            ).scalar()
            after = int(watermark or 0)
        tail = conn.execute(
            text(f"SELECT {columns} FROM messages m WHERE m.id > :after AND m.active = 1{scope}"),
            {**params, "after": after},
        ).all()
        indexed = (
            []
            if scope
            else conn.execute(
                text(
                    f"SELECT {columns} FROM messages_fts JOIN messages m ON m.id = "
                    "messages_fts.rowid WHERE messages_fts MATCH :match AND m.active = 1 "
                    "ORDER BY messages_fts.rowid DESC LIMIT :among"
                ),
                params,
            ).all()
        )
        known = {row.id for row in tail}
        candidates = [*tail, *(row for row in indexed if row.id not in known)]
        return _rank_in_memory(candidates, match, among, limit) if candidates else []


def _rank_in_memory(rows: Sequence[Any], match: str, among: int, limit: int) -> list[Any]:
    """The ``limit`` best of the newest ``among`` ``rows`` that ``match`` finds, by FTS5's
    bm25 in a private in-memory table of them (ties: newest first).

    The bm25 of the store's index would count every message holding each word (its weight)
    before ranking even one, which for a common word is as slow as ranking them all; over the
    candidates, which all hold every word, the words weigh the same and the rank says how
    often they occur in a message for its length."""
    by_id = {row.id: row for row in rows}
    with closing(sqlite3.connect(":memory:")) as memory:
        memory.execute("CREATE VIRTUAL TABLE found USING fts5(content, tool_name, tool_calls)")
        # Ascending ids: FTS5 writes a segment for every id lower than the one before it.
        memory.executemany(
            "INSERT INTO found(rowid, content, tool_name, tool_calls) VALUES (?, ?, ?, ?)",
            sorted((row.id, row.indexed, row.tool_name, row.tool_calls) for row in rows),
        )
        best = memory.execute(
            "SELECT rowid FROM (SELECT rowid, rank FROM found WHERE found MATCH ? "
            "ORDER BY rowid DESC LIMIT ?) ORDER BY rank, rowid DESC LIMIT ?",
            (match, among, limit),
        ).fetchall()
    return [by_id[rowid] for (rowid,) in best]
