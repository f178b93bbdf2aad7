"""Write statements built with SQLAlchemy Core and compiled once per dialect.

Hot-path statements are compiled to driver SQL at open and executed with ``exec_driver_sql``:
the statement is still Core (portable, one definition for SQLite and PostgreSQL) but skips the
per-call compile-cache and parameter-processing work, which dominates a one-row transaction.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    ColumnElement,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    select,
    update,
)
from sqlalchemy import Dialect as Compiler
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from hermes_core.store.backend import SESSION_ENDED
from hermes_plugins.sql_store.rows import ROUTE_READ
from hermes_plugins.sql_store.schema import (
    delivery_obligations,
    gateway_routing,
    messages,
    queued_events,
    seen_messages,
    sessions,
    state_meta,
)

if TYPE_CHECKING:
    from hermes_plugins.sql_store.dialects.base import Dialect

ROUTE_COPY_COLUMNS = ("session_id", "updated_at", "suspended", "resume_pending",
                      "active_turn_token", "active_turn_started_at", "entry_json")  # fmt: skip
TERMINAL = ("failed", "abandoned")
"""Delivery-ledger states that retention and the row cap apply to."""
MARKER_COLUMNS = ("active_turn_token", "active_turn_started_at", "updated_at")
MESSAGE_INSERT_COLUMNS = (
    "session_id", "role", "content", "tool_calls", "tool_call_id", "tool_name", "timestamp",
    "token_count", "finish_reason", "platform_message_id", "display_kind", "extra_json",
)  # fmt: skip
COUNTER_COLUMNS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                   "total_tokens", "estimated_cost_usd")  # fmt: skip


def idle_route(cutoff: Any) -> ColumnElement[bool]:
    """A routing row pruning may remove: idle since before ``cutoff`` (epoch seconds),
    not suspended, without a turn marker."""
    routing = gateway_routing.c
    return and_(
        routing.updated_at < cutoff, routing.suspended == 0, routing.active_turn_token.is_(None)
    )


class Prepared:
    """A Core statement compiled once for one SQLAlchemy dialect, run on a DBAPI cursor.

    Values fixed in the statement itself (``.values(active=0)``) become defaults of the
    parameters given at run time.
    """

    __slots__ = ("defaults", "pick", "sql")

    def __init__(self, statement: ClauseElement, compiler: Compiler) -> None:
        compiled = cast(SQLCompiler, statement.compile(dialect=compiler))
        self.sql = str(compiled)
        required = {bind.key for bind in compiled.binds.values() if bind.required}
        self.defaults: dict[str, Any] = {
            name: value for name, value in compiled.params.items() if name not in required
        }
        names = compiled.positiontup
        self.pick = None if names is None else _picker(tuple(names))
        """A positional driver's parameter tuple from the values given (None: named)."""

    def bind(self, params: Mapping[str, Any] | None = None) -> Any:
        """The driver parameters for ``params`` (a tuple for positional drivers, else a dict)."""
        values: Mapping[str, Any] = self.defaults if params is None else params
        if params is not None and self.defaults:
            values = {**self.defaults, **params}
        if self.pick is not None:
            return self.pick(values)
        return dict(values)

    def run(self, cursor: Any, params: Mapping[str, Any] | None = None) -> Any:
        """Execute on a DBAPI cursor."""
        cursor.execute(self.sql, self.bind(params))
        return cursor

    def run_many(self, cursor: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
        """Execute once per row as one ``executemany`` on a DBAPI cursor (psycopg pipelines
        the rows: one round trip, not one per row)."""
        cursor.executemany(self.sql, [self.bind(row) for row in rows])
        return cursor


def _picker(names: tuple[str, ...]) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``values -> tuple(values[name] for name in names)``, as one C call for two names or
    more (``itemgetter`` then returns a tuple); a missing name raises ``KeyError(name)``."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda values: tuple(values[name] for name in names)


def _upsert_route(dialect: Dialect) -> ClauseElement:
    """Single-row routing upsert that increments ``revision`` (the dialect's ON CONFLICT)."""
    values: dict[str, Any] = {
        name: bindparam(name) for name in ("session_key", *ROUTE_COPY_COLUMNS)
    }
    values["revision"] = bindparam("revision")
    statement = dialect.insert(gateway_routing).values(values)
    changes: dict[str, Any] = {name: statement.excluded[name] for name in ROUTE_COPY_COLUMNS}
    changes["revision"] = gateway_routing.c.revision + literal_column("1")
    return statement.on_conflict_do_update(index_elements=["session_key"], set_=changes)


class Statements:
    """Every write statement of the SQL backend, built for the store's ``dialect`` and
    compiled once with ``compiler``."""

    def __init__(self, dialect: Dialect, compiler: Compiler) -> None:
        def prepare(statement: ClauseElement) -> Prepared:
            return Prepared(statement, compiler)

        routing, by_key = gateway_routing, gateway_routing.c.session_key == bindparam("session_key")
        session = sessions.c.id == bindparam("session_id")
        insert_fn = dialect.insert
        self.upsert_route = prepare(_upsert_route(dialect))
        # A shared store's checked routing writes: a new key only if no row appeared, an
        # existing row only at the revision read (``expected``).
        route: dict[str, Any] = {
            name: bindparam(name) for name in ("session_key", *ROUTE_COPY_COLUMNS)
        }
        self.insert_route = prepare(
            insert_fn(routing)
            .values(route | {"revision": bindparam("revision")})
            .on_conflict_do_nothing(index_elements=["session_key"])
        )
        copies: dict[str, Any] = {name: bindparam(name) for name in ROUTE_COPY_COLUMNS}
        copies["revision"] = routing.c.revision + literal_column("1")
        at_revision = routing.c.revision == bindparam("expected")
        self.update_route = prepare(update(routing).where(by_key, at_revision).values(copies))
        marker: dict[str, Any] = {name: bindparam(name) for name in MARKER_COLUMNS}
        marker["revision"] = routing.c.revision + literal_column("1")
        # the entry itself only when the turn-scoped metadata changed with the marker
        marker["entry_json"] = func.coalesce(bindparam("entry_json"), routing.c.entry_json)
        self.set_marker = prepare(update(routing).where(by_key).values(marker))
        self.clear_marker = prepare(
            update(routing)
            .where(by_key, routing.c.active_turn_token == bindparam("token"))
            .values(marker)
        )
        self.prune_route = prepare(delete(routing).where(by_key, idle_route(bindparam("cutoff"))))
        insert_message = messages.insert().values(
            {name: bindparam(name) for name in MESSAGE_INSERT_COLUMNS}
        )
        if dialect.returning_ids:  # else the id comes through lastrowid
            insert_message = insert_message.returning(messages.c.id)
        self.insert_message = prepare(insert_message)
        self.add_counters = prepare(
            update(sessions)
            .where(session)
            .values(
                {name: sessions.c[name] + bindparam(name) for name in COUNTER_COLUMNS}
                | {
                    "cost_status": func.coalesce(bindparam("cost_status"), sessions.c.cost_status),
                    "last_activity_at": func.coalesce(
                        bindparam("last_activity_at"), sessions.c.last_activity_at
                    ),
                }
            )
        )
        self.insert_session = prepare(
            sessions.insert().values({column.name: bindparam(column.name) for column in sessions.c})
        )
        self.end_session = prepare(
            update(sessions)
            .where(session, sessions.c.ended_at.is_(None))
            .values(ended_at=bindparam("ended_at"), end_reason=bindparam("end_reason"))
        )
        self.reopen_session = prepare(
            update(sessions).where(session).values(ended_at=None, end_reason=None)
        )
        self.deactivate_messages = prepare(
            update(messages)
            .where(messages.c.session_id == bindparam("session_id"), messages.c.active == 1)
            .values(active=0)
        )
        self.deactivate_message = prepare(
            update(messages)
            .where(
                messages.c.session_id == bindparam("session_id"),
                messages.c.id == bindparam("message_id"),
                messages.c.active == 1,
            )
            .values(active=0)
        )
        self.set_message_count = prepare(
            update(sessions).where(session).values(message_count=bindparam("message_count"))
        )
        self.uncount_messages = prepare(
            update(sessions)
            .where(session)
            .values(message_count=sessions.c.message_count - bindparam("removed"))
        )
        self.delete_queued = prepare(
            delete(queued_events).where(queued_events.c.id == bindparam("event_id"))
        )
        queue_columns = ("session_key", "internal", "bound_session_id", "event_json")
        self.insert_queued = prepare(  # or ``postgresql_turns.QUEUE_EVENT`` (one round trip)
            queued_events.insert().values(
                {name: bindparam(name) for name in (*queue_columns, "enqueued_at", "updated_at")}
            )
        )
        self.lane_queued = prepare(
            select(queued_events.c.id, queued_events.c.session_key, queued_events.c.event_json)
            .where(
                queued_events.c.session_key == bindparam("session_key"),
                queued_events.c.dead_at.is_(None),
            )
            .order_by(queued_events.c.id)
        )
        self.insert_obligation = prepare(
            insert_fn(delivery_obligations)
            .values({column.name: bindparam(column.name) for column in delivery_obligations.c})
            .on_conflict_do_nothing(index_elements=["obligation_id"])
        )
        by_obligation = delivery_obligations.c.obligation_id == bindparam("obligation_id")
        self.delete_obligation = prepare(delete(delivery_obligations).where(by_obligation))
        self.delete_terminal_obligation = prepare(
            delete(delivery_obligations).where(
                by_obligation,
                delivery_obligations.c.state.in_([literal_column(f"'{s}'") for s in TERMINAL]),
            )
        )
        self.insert_seen = prepare(
            insert_fn(seen_messages)
            .values(
                session_key=bindparam("session_key"),
                message_id=bindparam("message_id"),
                seen_at=bindparam("seen_at"),
            )
            .on_conflict_do_nothing(index_elements=["session_key", "message_id"])
        )
        ended = (
            select(sessions.c.end_reason.is_not(None))
            .where(sessions.c.id == gateway_routing.c.session_id)
            .scalar_subquery()
            .label(SESSION_ENDED)
        )
        self.select_route = prepare(select(*ROUTE_READ, ended).where(by_key))
        self._route_columns = (routing.c.session_key, *ROUTE_READ, ended)
        self._select_routes: dict[int, Prepared] = {}
        self._prepare = prepare
        self.select_session = prepare(select(sessions).where(session))
        self.newest_session = prepare(
            select(sessions)
            .where(sessions.c.session_key == bindparam("session_key"))
            .order_by(sessions.c.started_at.desc())
            .limit(1)
        )
        self.delete_meta = prepare(delete(state_meta).where(state_meta.c.key == bindparam("key")))
        self.insert_meta = prepare(
            state_meta.insert().values(key=bindparam("key"), value=bindparam("value"))
        )

    def select_routes(self, count: int) -> tuple[Prepared, int]:
        """The read of up to ``count`` keys' routes (as :attr:`select_route`, with the key),
        parameters ``k0``, ``k1``, ...; with the number of keys it takes, the next power of two
        (the caller repeats a key to fill it), so a few statements serve every count and each is
        compiled, and prepared by the server, once."""
        slots = 1 << max(count - 1, 0).bit_length()
        prepared = self._select_routes.get(slots)
        if prepared is None:
            keys = gateway_routing.c.session_key.in_([bindparam(f"k{i}") for i in range(slots)])
            prepared = self._prepare(select(*self._route_columns).where(keys))
            self._select_routes[slots] = prepared
        return prepared, slots
