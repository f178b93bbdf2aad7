"""Full-text search over active messages: FTS5, tsvector, or a substring scan."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import Any

from sqlalchemy import Connection, func, literal_column, select, text
from sqlalchemy.sql import ColumnElement, Select

from hermes_core.store.backend import SearchHit
from hermes_plugins.sql_store.schema import (
    FTS_WATERMARK,
    TAIL_PROJECTION,
    messages,
    sessions,
    state_meta,
)

SNIPPET_CHARS = 200


def fts5_query(query: str) -> str:
    """Every whitespace-separated token quoted (inner quotes doubled); all are required."""
    return " ".join('"' + token.replace('"', '""') + '"' for token in query.split())


def snippet_around(content: str | None, tokens: list[str]) -> str:
    """At most 200 characters of ``content`` around the first token found."""
    body = content or ""
    lowered = body.lower()
    at = min((i for i in (lowered.find(t.lower()) for t in tokens) if i >= 0), default=0)
    start = max(0, at - SNIPPET_CHARS // 4)
    return body[start : start + SNIPPET_CHARS]


def _scoped(query: Select[Any], session_id: str | None, session_key: str | None) -> Select[Any]:
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


def indexed(
    conn: Connection,
    dialect: str,
    query: str,
    session_id: str | None,
    session_key: str | None,
    limit: int,
) -> list[SearchHit]:
    """Search through the derived index, best rank first."""
    tokens = query.split()
    if not tokens:
        return []
    if dialect == "sqlite":
        return _hits(
            _sqlite_ranked(conn, fts5_query(query), session_id, session_key, limit), tokens
        )
    columns = (messages.c.id, messages.c.session_id, messages.c.role, messages.c.timestamp,
               messages.c.content)  # fmt: skip
    tsquery = func.plainto_tsquery(literal_column("'simple'::regconfig"), query)
    search_tsv: ColumnElement[Any] = literal_column("messages.search_tsv")
    statement = (
        _scoped(select(*columns), session_id, session_key)
        .where(search_tsv.op("@@")(tsquery))
        .order_by(func.ts_rank(search_tsv, tsquery).desc(), messages.c.id)
        .limit(limit)
    )
    return _hits(conn.execute(statement), tokens)


def _sqlite_ranked(
    conn: Connection, match: str, session_id: str | None, session_key: str | None, limit: int
) -> list[Any]:
    """FTS5 hits, best first: those of the index (the messages up to its watermark) merged by
    rank with those of the messages past it, matched through a private in-memory FTS5 table of
    the same tokenizer, so the newest messages are found exactly as indexed ones are."""
    scope, params = "", {"match": match, "limit": limit}
    if session_id is not None:
        scope += " AND m.session_id = :session_id"
        params["session_id"] = session_id
    if session_key is not None:
        scope += " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = :session_key)"
        params["session_key"] = session_key
    # Read before the index: a catch-up committed in between makes rows show twice (merged
    # below), never not at all.
    watermark = conn.execute(
        select(state_meta.c.value).where(state_meta.c.key == FTS_WATERMARK)
    ).scalar()
    indexed = conn.execute(
        text(
            "SELECT m.id, m.session_id, m.role, m.timestamp, m.content, messages_fts.rank AS rank "
            "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
            f"WHERE messages_fts MATCH :match AND m.active = 1{scope} "
            "ORDER BY messages_fts.rank LIMIT :limit"
        ),
        params,
    ).all()
    tail = conn.execute(
        text(
            "SELECT m.id, m.session_id, m.role, m.timestamp, m.content, "
            f"{TAIL_PROJECTION} AS indexed, m.tool_name, m.tool_calls FROM messages m "
            f"WHERE m.id > :after AND m.active = 1{scope}"
        ),
        {**params, "after": int(watermark or 0)},
    ).all()
    ranked = [(row.rank, row) for row in indexed]
    known = {row.id for row in indexed}
    tail = [row for row in tail if row.id not in known]
    if tail:
        ranked.extend(_match_in_memory(tail, match, limit))
    ranked.sort(key=lambda pair: pair[0])
    return [row for _rank, row in ranked[:limit]]


def _match_in_memory(rows: list[Any], match: str, limit: int) -> list[tuple[float, Any]]:
    """(FTS5 rank, row) of the ``rows`` (past the watermark) that ``match`` finds."""
    by_id = {row.id: row for row in rows}
    with closing(sqlite3.connect(":memory:")) as memory:
        memory.execute("CREATE VIRTUAL TABLE tail USING fts5(content, tool_name, tool_calls)")
        memory.executemany(
            "INSERT INTO tail(rowid, content, tool_name, tool_calls) VALUES (?, ?, ?, ?)",
            [(row.id, row.indexed, row.tool_name, row.tool_calls) for row in rows],
        )
        found = memory.execute(
            "SELECT rowid, rank FROM tail WHERE tail MATCH ? ORDER BY rank LIMIT ?", (match, limit)
        ).fetchall()
    return [(rank, by_id[rowid]) for rowid, rank in found]


def scan(
    conn: Connection, query: str, session_id: str | None, session_key: str | None, limit: int
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
    statement = _scoped(
        select(messages.c.id, messages.c.session_id, messages.c.role, messages.c.timestamp,
               messages.c.content),
        session_id,
        session_key,
    )  # fmt: skip
    position = func.instr if conn.dialect.name == "sqlite" else func.strpos
    for token in tokens:
        statement = statement.where(position(haystack, token.lower()) > 0)
    statement = statement.order_by(messages.c.id.desc()).limit(limit)
    return _hits(conn.execute(statement), tokens)
