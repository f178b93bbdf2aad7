"""PostgreSQL's full-text index, the GIN index over the generated ``tsvector`` column
(:class:`TsvectorIndex`), and how a search reads it: windows of message ids newest first, each
walked by primary key while the word is common enough, or the GIN index once it is rare."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Connection,
    Select,
    String,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    true,
)  # fmt: skip

from hermes_core.domain.errors import StoreError
from hermes_plugins.sql_store.schema import messages
from hermes_plugins.sql_store.search import SearchIndex, scoped

_FAILED_REINDEX = (
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE NOT i.indisvalid AND c.relname LIKE 'ix\\_messages\\_search\\_ccnew%%'"
)
"""The invalid copies an interrupted ``REINDEX ... CONCURRENTLY`` of the search index left."""
_PROBE = "SELECT id FROM messages WHERE search_tsv @@ plainto_tsquery('simple', 'hermesprobe')"
_HIT = ("id", "session_id", "role", "timestamp", "content")
PROBE_ROWS = 2_000
"""Ids of the newest messages a search walks first, to tell a common word from a rare one."""
SAMPLES = 10
SAMPLE_IDS = 100
"""With its first walk a search counts its word in ``SAMPLES`` windows of ``SAMPLE_IDS`` ids
spread evenly over all ids, the oldest first: the rate at which the GIN index would read the
older matches."""

_TSQUERY = func.plainto_tsquery(
    literal_column("'simple'::regconfig"), bindparam("query", type_=String())
)
_TSV: ColumnElement[Any] = literal_column("messages.search_tsv")
_MATCHES = _TSV.op("@@")(_TSQUERY)
_WALKED = _MATCHES.is_(True)
"""Not a form the GIN index serves: the rows are walked."""


def next_window(found: int, rest: int, walked: int, older: float) -> int | None:
    """Ids to walk next, having found ``found`` matches in the newest ``walked`` ids and
    wanting ``rest`` more, where the GIN index would read about ``older`` matches below them:
    the rows that the rate seen says the rest takes, and at least as many as walked (the
    windows at least double), or, none found yet, as many as walked; None (read the index
    instead) once that costs more rows than those matches. Newer messages without the word
    so cost at most about what reading its older matches would."""
    if found:
        rows = rest * walked / found
        return max(walked, math.ceil(rows)) if rows <= older else None
    return walked if walked < older else None


def _newest(
    where: ColumnElement[Any], by: ColumnElement[Any], count: Any, session_id: str | None = None,
    session_key: str | None = None,
) -> Select[Any]:  # fmt: skip
    """The ``count`` newest (by ``by``) active messages in scope where ``where``, with their
    ``ts_rank`` (computed for those only)."""
    inner = (
        scoped(select(*(messages.c[name] for name in _HIT), _TSV.label("tsv")),
               session_id, session_key)
        .where(where)
        .order_by(by.desc())
        .limit(count)
        .subquery()
    )  # fmt: skip
    return select(*(inner.c[name] for name in _HIT),
                  func.ts_rank(inner.c.tsv, _TSQUERY).label("rank"))  # fmt: skip


@cache
def _unscoped() -> tuple[Select[Any], Select[Any], Select[Any], Select[Any]]:
    """An unscoped search's statements, built once: the newest id (turning JIT off for the
    transaction), the sampled count (window ``n`` from ``low_n`` to ``high_n``) with the
    newest ids walked, a window walked (``low`` to ``high``), and the GIN index read below
    ``high`` (``id + 0``: not an ordered walk of the primary key). Every bound is a
    parameter, so that the planner sizes each read by its ids."""
    ids = messages.c.id
    newest = select(func.max(ids).label("top"), func.set_config("jit", "off", true()))
    spread = or_(*(ids.between(bindparam(f"low{n}"), bindparam(f"high{n}"))
                   for n in range(SAMPLES)))  # fmt: skip
    sampled = select(func.count().label("sampled")).where(_WALKED & spread).subquery("sample")
    rest: BindParameter[int] = bindparam("rest")
    window = _newest(_WALKED & ids.between(bindparam("low"), bindparam("high")), ids, rest)
    probe = window.subquery("probe")
    first = select(sampled.c.sampled, probe).select_from(sampled.outerjoin(probe, true()))
    below = _MATCHES & (ids + 0 <= bindparam("high"))
    return newest, first, window, _newest(below, ids + 0, rest)


def _sample_bounds(top: int) -> dict[str, int]:
    """The bounds of the :data:`SAMPLES` windows of :data:`SAMPLE_IDS` ids spread evenly
    over the ids up to ``top``, the oldest first."""
    step = top // SAMPLES
    bounds = {f"low{n}": step * n for n in range(SAMPLES)}
    return bounds | {f"high{n}": step * n + SAMPLE_IDS - 1 for n in range(SAMPLES)}


def _best(rows: Sequence[Any], limit: int) -> list[Any]:
    """The ``limit`` best-ranked of ``rows``, ties newest first."""
    return sorted(rows, key=lambda row: (-row.rank, -row.id))[:limit]


class TsvectorIndex(SearchIndex):
    """The GIN index over the generated ``tsvector`` column; the server keeps it current."""

    def _ranked(
        self,
        conn: Connection,
        query: str,
        session_id: str | None,
        session_key: str | None,
        limit: int,
        among: int,
    ) -> list[Any]:
        """The ``limit`` best by ``ts_rank`` of the ``among`` newest matches in scope.

        The planner's choice between walking the primary key backwards (cheap for a common
        word) and reading the GIN index (cheap for a rare one) rests on statistics that
        misjudge words they do not list (a rare word walked 27 s over 5,000,000 messages),
        so the search measures instead. It reads the newest id, then walks the newest
        :data:`PROBE_ROWS` ids and counts the word in a sample spread over all of them
        (:data:`SAMPLES`); then, newest first, it walks windows of ids below, each bounded
        (:func:`next_window`), while that costs fewer rows than reading the word's older
        matches at the sampled rate would, and otherwise reads the GIN index once for the
        rest. A rare word takes three statements; a common one is walked to past newer
        messages without it, for no more rows than reading its older matches would take.
        Every id range is bound by value: ranges computed in a statement from its newest id
        are costed at the planner's default guess (25,000 rows each over 5,000,000 messages),
        which set off JIT compilation, 0.6 s for a read of 2 ms. JIT is off for the
        transaction too, for a store without statistics, where every range gets that guess.
        A scope's few messages are walked through its own index."""
        params: dict[str, Any] = {"query": query}
        ids = messages.c.id
        if session_id is not None or session_key is not None:
            statement = _newest(_WALKED, ids, among, session_id, session_key)
            return _best(conn.execute(statement, params).all(), limit)
        newest, first, window, below = _unscoped()
        top = conn.execute(newest).scalar()
        if top is None:
            return []
        probe = {"low": top - PROBE_ROWS + 1, "high": top, "rest": among}
        rows = conn.execute(first, {**params, **probe, **_sample_bounds(top)}).all()
        found = [row for row in rows if row.id is not None]
        high, walked = top - PROBE_ROWS, PROBE_ROWS
        rate = rows[0].sampled / (SAMPLES * SAMPLE_IDS)
        while (rest := among - len(found)) and high > 0:
            size = next_window(len(found), rest, walked, rate * high)
            if size is None:
                found += conn.execute(below, {**params, "high": high, "rest": rest}).all()
                break
            bounds = {"low": high - size + 1, "high": high, "rest": rest}
            found += conn.execute(window, {**params, **bounds}).all()
            high, walked = high - size, walked + size
        return _best(found, limit)

    def reindex_fts(self) -> None:
        """``REINDEX INDEX CONCURRENTLY`` on a connection of its own (no writer's), which
        blocks neither message writes nor searches; an invalid copy a failed run left behind
        is dropped first. It runs without a statement timeout (a large index may take minutes)
        and waits for the transactions that use the old index; :meth:`start_fts_rebuild` then
        only clears the stale record."""
        with self._store.read("rebuilding the full-text index") as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("SET statement_timeout = 0")
            try:
                for name in conn.exec_driver_sql(_FAILED_REINDEX).scalars().all():
                    conn.exec_driver_sql(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
                conn.exec_driver_sql("REINDEX INDEX CONCURRENTLY ix_messages_search")
            finally:
                conn.exec_driver_sql("RESET statement_timeout")

    def _empty(self, cursor: Any) -> int:
        """Nothing: :meth:`reindex_fts` rebuilt the index already."""
        return 0

    def _refill(self, newest: int) -> None:
        """Nothing: the server indexes every message as it is stored."""

    def index_backlog(self) -> bool:
        """False: no message waits to be indexed."""
        return False

    def inserted(self, message_id: int) -> None:
        """Nothing (and ids come by ``RETURNING``)."""

    def after_commit(self) -> None:
        """Nothing: the index is current with every commit."""

    def rolled_back(self) -> None:
        """Nothing."""

    def fts_problems(self) -> list[str]:
        """A real query through the index."""
        if self.state == "unavailable":
            return []
        try:
            with self._store.read("probing the search index") as conn:
                conn.exec_driver_sql(_PROBE).all()
        except StoreError as exc:  # any failure is the finding
            return [f"the search index cannot be queried: {exc}"]
        return []
