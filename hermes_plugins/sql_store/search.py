"""Full-text search over active messages: FTS5, tsvector, or a substring scan."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, literal_column, select, text
from sqlalchemy.sql import ColumnElement, Select

from hermes_core.store.backend import SearchHit
from hermes_plugins.sql_store.schema import messages, sessions

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
    if dialect == "sqlite":  # FTS5 is SQLite's own syntax: MATCH and the rank column
        sql = (
            "SELECT m.id, m.session_id, m.role, m.timestamp, m.content FROM messages_fts "
            "JOIN messages m ON m.id = messages_fts.rowid WHERE messages_fts MATCH :match "
            "AND m.active = 1"
        )
        params: dict[str, Any] = {"match": fts5_query(query), "limit": limit}
        if session_id is not None:
            sql += " AND m.session_id = :session_id"
            params["session_id"] = session_id
        if session_key is not None:
            sql += " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = :session_key)"
            params["session_key"] = session_key
        sql += " ORDER BY messages_fts.rank LIMIT :limit"
        return _hits(conn.execute(text(sql), params), tokens)
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
