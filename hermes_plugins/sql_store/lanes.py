"""The lanes ``ls`` lists: filtered, ordered and limited in the database, each routing row
joined with its session's message count, a page at a time by keyset (the sort values of the
last row of the page before), so a page costs the same however many lanes the store holds."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    ColumnElement,
    Select,
    and_,
    cast,
    exists,
    false,
    func,
    or_,
    select,
    type_coerce,
)

from hermes_core.store.operator import LaneFilter, LaneRow
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.rows import ROUTE_READ, route_entry
from hermes_plugins.sql_store.schema import gateway_routing, queued_events, sessions


def _entry_field(dialect: str, name: str) -> ColumnElement[Any]:
    """A text field of ``entry_json`` (SQLite ``json_extract``, PostgreSQL ``->>``)."""
    column = gateway_routing.c.entry_json
    as_json = type_coerce(column, JSON) if dialect == "sqlite" else cast(column, JSON)
    field: ColumnElement[Any] = as_json[name].as_string()
    return field


def _order(dialect: str, sort: str) -> list[tuple[ColumnElement[Any], bool]]:
    """The sort terms of ``--sort``, each with whether it descends: ties on the sort's own
    value fall to the newest activity, then to the session key (the order ``ls`` has always
    printed). ``updated`` is served by the index ``ix_gateway_routing_updated``, ``key`` by
    the primary key; ``created`` and ``messages`` are ranked in the database."""
    routing = gateway_routing.c
    newest: list[tuple[ColumnElement[Any], bool]] = [
        (routing.updated_at, True), (routing.session_key, False),
    ]  # fmt: skip
    if sort == "key":
        return [(routing.session_key, False)]
    if sort == "created":
        return [(_entry_field(dialect, "created_at"), True), *newest]
    if sort == "messages":
        return [(func.coalesce(sessions.c.message_count, 0), True), *newest]
    return newest


def _after(order: list[tuple[ColumnElement[Any], bool]], last: tuple[Any, ...]) -> Any:
    """Rows that come after the row whose sort values are ``last``."""
    later: ColumnElement[bool] = false()
    for index in reversed(range(len(order))):
        term, descending = order[index]
        beyond = term < last[index] if descending else term > last[index]
        same = [order[i][0] == last[i] for i in range(index)]
        later = or_(and_(*same, beyond), later) if same else or_(beyond, later)
    return later


def _where(dialect: str, lanes: LaneFilter) -> list[Any]:
    routing = gateway_routing.c
    where: list[Any] = []
    if lanes.platform is not None:
        where.append(_entry_field(dialect, "platform") == lanes.platform)
    if lanes.active_since is not None:
        where.append(routing.updated_at >= lanes.active_since)
    if lanes.suspended:
        where.append(routing.suspended != 0)
    if lanes.resume_pending:
        where.append(routing.resume_pending != 0)
    if lanes.dead_lettered:
        events = queued_events.c
        where.append(
            exists().where(events.session_key == routing.session_key, events.dead_at.is_not(None))
        )
    return where


def lane_query(
    dialect: str, lanes: LaneFilter, after: tuple[Any, ...] | None, limit: int
) -> Select[Any]:
    """The statement of :func:`lane_rows`: the :data:`ROUTE_READ` columns, the message count,
    then the sort values."""
    order = _order(dialect, lanes.sort)
    query = (
        select(*ROUTE_READ, func.coalesce(sessions.c.message_count, 0), *(t for t, _ in order))
        .select_from(
            gateway_routing.outerjoin(sessions, sessions.c.id == gateway_routing.c.session_id)
        )
        .where(*_where(dialect, lanes))
        .order_by(*(term.desc() if descending else term for term, descending in order))
        .limit(limit)
    )
    return query if after is None else query.where(_after(order, after))


def lane_rows(
    conn: SqlConnection, lanes: LaneFilter, after: tuple[Any, ...] | None, limit: int
) -> list[LaneRow]:
    """Up to ``limit`` lanes of ``lanes`` in its order, after the row at ``after``."""
    with conn.read("listing lanes") as connection:
        rows = connection.execute(lane_query(conn.dialect.name, lanes, after, limit)).all()
    names, width = [column.name for column in ROUTE_READ], len(ROUTE_READ)
    return [
        LaneRow(route_entry(dict(zip(names, row[:width], strict=True))), int(row[width]),
                tuple(row[width + 1 :]))
        for row in rows
    ]  # fmt: skip
