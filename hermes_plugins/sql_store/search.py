"""Full-text search over active messages: through the dialect's derived index (FTS5,
``tsvector``), or a substring scan while the index is stale or unavailable.

:class:`SearchIndex` is the store's index and its state; each dialect has its own kind
(``dialects/sqlite_search.py``, ``dialects/postgresql.py``), chosen when the store opens.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql import Select

from hermes_core.store.backend import SearchHit
from hermes_plugins.sql_store.schema import messages, sessions, state_meta

if TYPE_CHECKING:
    from hermes_plugins.sql_store.connection import SqlConnection
    from hermes_plugins.sql_store.dialects.base import Dialect

logger = logging.getLogger(__name__)

SNIPPET_CHARS = 200
STALE = "fts_stale"
"""``state_meta`` key, present while the index is stale (set when a fault disabled it)."""


def snippet_around(content: str | None, tokens: list[str]) -> str:
    """At most 200 characters of ``content`` around the first token found."""
    body = content or ""
    lowered = body.lower()
    at = min((i for i in (lowered.find(t.lower()) for t in tokens) if i >= 0), default=0)
    start = max(0, at - SNIPPET_CHARS // 4)
    return body[start : start + SNIPPET_CHARS]


def scoped(query: Select[Any], session_id: str | None, session_key: str | None) -> Select[Any]:
    """``query`` over the active messages of a session, or of a key's sessions, or all."""
    query = query.where(messages.c.active == 1)
    if session_id is not None:
        query = query.where(messages.c.session_id == session_id)
    if session_key is not None:
        query = query.where(
            messages.c.session_id.in_(
                select(sessions.c.id).where(sessions.c.session_key == session_key)
            )
        )
    return query


def _hits(rows: Any, tokens: list[str]) -> list[SearchHit]:
    return [
        SearchHit(
            session_id=row.session_id,
            message_id=int(row.id),
            role=row.role,
            timestamp=float(row.timestamp),
            snippet=snippet_around(row.content, tokens),
        )
        for row in rows
    ]


def scan(
    conn: Connection,
    dialect: Dialect,
    query: str,
    session_id: str | None,
    session_key: str | None,
    limit: int,
) -> list[SearchHit]:
    """Case-insensitive substring scan (no index): every token must occur; newest first."""
    tokens = query.split()
    if not tokens:
        return []
    haystack = func.lower(
        func.coalesce(messages.c.content, "")
        + " "
        + func.coalesce(messages.c.tool_name, "")
        + " "
        + func.coalesce(messages.c.tool_calls, "")
    )
    statement = scoped(
        select(messages.c.id, messages.c.session_id, messages.c.role, messages.c.timestamp,
               messages.c.content),
        session_id,
        session_key,
    )  # fmt: skip
    for token in tokens:
        statement = statement.where(dialect.position(haystack, token.lower()) > 0)
    statement = statement.order_by(messages.c.id.desc()).limit(limit)
    return _hits(conn.execute(statement), tokens)


class SearchIndex(ABC):
    """The store's derived full-text index and its ``state``: ``ok``; ``stale`` (a fault
    disabled it; search scans until a rebuild); ``unavailable`` (this SQLite lacks FTS5).

    A search ranks the newest :attr:`rank_among` matches that its scope keeps (walked newest
    first through the index), never all of them: a term that a third of the messages hold
    costs what a rare one does.

    The store's connection tells it of each commit and rollback of a writer connection and of
    each message inserted without ``RETURNING`` (:meth:`after_commit`, :meth:`rolled_back`,
    :meth:`inserted`: nothing to do unless the index trails the messages). Each dialect's
    kind declares every step, if only to say that it needs nothing there."""

    rank_among = 1_000
    """Matches ranked at most: the newest ones that the search's scope keeps."""

    def __init__(self, store: SqlConnection, state: str) -> None:
        self._store = store
        self.state = state
        self._warned = False
        """Whether the store warned that search scans (once per store)."""

    @staticmethod
    def stored_state(conn: Connection) -> str:
        """``stale`` while the database records the index as stale, else ``ok``."""
        stale = conn.execute(select(state_meta.c.value).where(state_meta.c.key == STALE))
        return "stale" if stale.first() is not None else "ok"

    # -- search -------------------------------------------------------------------------------

    def search(
        self, query: str, *, session_id: str | None, session_key: str | None, limit: int
    ) -> list[SearchHit]:
        """Full-text search; a failing index (or a stale one) degrades to a scan."""
        store = self._store
        with store.read("searching transcripts") as conn:
            if self.state == "ok":
                try:
                    tokens = query.split()
                    if not tokens:
                        return []
                    found = self._ranked(
                        conn, query, session_id, session_key, limit, self.rank_among
                    )
                    return _hits(found, tokens)
                except SQLAlchemyError as exc:
                    # Only a write marks the index stale (it can tell the index's faults from
                    # its own); this query is answered by a scan.
                    conn.rollback()
                    logger.warning(
                        "%s: a full-text search failed (%s); answering it by scan",
                        store.display, store.translate(exc, "searching"),
                    )  # fmt: skip
            elif not self._warned:
                self._warned = True
                logger.warning(
                    "%s: full-text index %s; searching by scan", store.display, self.state
                )
            return scan(conn, store.dialect, query, session_id, session_key, limit)

    @abstractmethod
    def _ranked(
        self,
        conn: Connection,
        query: str,
        session_id: str | None,
        session_key: str | None,
        limit: int,
        among: int,
    ) -> list[Any]:
        """The ``limit`` best-ranked (ties: newest first) of the ``among`` newest matches in
        scope (message rows)."""

    # -- rebuilding -----------------------------------------------------------------------------

    def rebuild_fts(self) -> bool:
        """Rebuild the index and clear its stale record (:meth:`reindex_fts`,
        :meth:`start_fts_rebuild`, then the whole backlog indexed); False when it is
        unavailable."""
        self.reindex_fts()
        started = self.start_fts_rebuild()
        while started and self.index_backlog():
            pass
        return started

    @abstractmethod
    def reindex_fts(self) -> None:
        """Rebuild the index off the writer, where the database can."""

    def start_fts_rebuild(self) -> bool:
        """Start a rebuild of the index and clear its stale record; False when the index is
        unavailable. The index is emptied in the same transaction where it is refilled later
        (:meth:`index_backlog`), or rebuilt already (:meth:`reindex_fts`)."""
        if self.state == "unavailable":
            return False
        store = self._store
        with store.write("rebuilding the full-text index", ddl=True) as cursor:
            newest = self._empty(cursor)
            store.sql.delete_meta.run(cursor, {"key": STALE})
        store.engine.dispose()  # pooled readers may still hold the broken index's connection
        self.state = "ok"
        self._refill(newest)
        return True

    @abstractmethod
    def _empty(self, cursor: Any) -> int:
        """Empty the index for a rebuild (on the rebuild's cursor); the newest message id."""

    @abstractmethod
    def _refill(self, newest: int) -> None:
        """After the rebuild's commit: index the messages up to ``newest`` from now on."""

    @abstractmethod
    def index_backlog(self) -> bool:
        """Index one batch of the messages the index trails by; True while enough wait for
        another batch."""

    @abstractmethod
    def fts_problems(self) -> list[str]:
        """The index's own integrity check and a real query; ``[]`` when healthy or
        unavailable."""

    # -- following the writer ---------------------------------------------------------------------

    @abstractmethod
    def inserted(self, message_id: int) -> None:
        """A message was inserted on a writer connection (``lastrowid``: ``message_id``)."""

    @abstractmethod
    def after_commit(self) -> None:
        """A writer connection committed, on the calling thread (its slot locked)."""

    @abstractmethod
    def rolled_back(self) -> None:
        """A writer connection's transaction was rolled back."""
