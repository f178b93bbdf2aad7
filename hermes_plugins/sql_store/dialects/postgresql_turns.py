"""PostgreSQL's turn statements: each commit of a turn in one round trip.

On SQLite a statement costs microseconds, so a turn's writes stay separate statements. On
PostgreSQL every statement is a round trip to the server; data-modifying CTEs let the start of a
turn (redelivery row, marker, dequeue, user message) and its finish (reply, ledger row, marker
cleared) each travel as one statement, and so do a new session (routing row, predecessor's
end, session row) and a queued event (the event, its message seen). On a shared store a
turn's start and finish are fenced within their statement: given the turn's lease token
(``lease``), each locks the lane's lease row (``FOR KEY SHARE``, until the transaction ends:
no grant changes its owner meanwhile, while another process's refused grant may mark it) and
writes nothing unless the token still holds it, which it returns. Parameters carry explicit casts: a
NULL parameter has no type PostgreSQL could infer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from hermes_core.store.backend import Obligation
from hermes_plugins.sql_store.schema import sessions
from hermes_plugins.sql_store.statements import MESSAGE_INSERT_COLUMNS

_MESSAGE_TYPES = {
    "timestamp": "float8", "token_count": "int4",
}  # fmt: skip
_MESSAGE_COLUMNS = ", ".join(MESSAGE_INSERT_COLUMNS)
_MESSAGE_VALUES = ", ".join(
    f"%(m_{name})s::{_MESSAGE_TYPES.get(name, 'text')}" for name in MESSAGE_INSERT_COLUMNS
)


def _fenced(key: str) -> str:
    """The CTEs ``lease`` (the lane's lease row under the token, locked ``FOR KEY SHARE``) and
    ``fenced`` (one row when the write may go ahead: no token given, or the token holds the
    lease)."""
    return f"""lease AS (
    SELECT 1 FROM session_turn_leases
    WHERE session_key = {key} AND token = %(lease)s::text FOR KEY SHARE
), fenced AS (
    SELECT 1 WHERE %(lease)s::text IS NULL OR EXISTS (SELECT 1 FROM lease)
)"""


BEGIN_TURN = f"""
WITH {_fenced("%(session_key)s::text")}, seen AS (
    INSERT INTO seen_messages (session_key, message_id, seen_at)
    SELECT %(session_key)s::text, %(seen)s::text, %(seen_at)s::float8
    WHERE %(seen)s::text IS NOT NULL AND EXISTS (SELECT 1 FROM fenced)
    ON CONFLICT DO NOTHING
    RETURNING 1
), go AS (
    SELECT 1 WHERE EXISTS (SELECT 1 FROM fenced)
        AND (%(seen)s::text IS NULL OR EXISTS (SELECT 1 FROM seen))
        AND (%(event_id)s::int4 IS NULL
             OR EXISTS (SELECT 1 FROM queued_events WHERE id = %(event_id)s::int4))
), marker AS (
    UPDATE gateway_routing
    SET active_turn_token = %(active_turn_token)s::text,
        active_turn_started_at = %(active_turn_started_at)s::float8,
        updated_at = %(updated_at)s::float8, revision = revision + 1,
        entry_json = COALESCE(%(entry_json)s::text, entry_json)
    WHERE session_key = %(session_key)s::text AND EXISTS (SELECT 1 FROM go)
    RETURNING 1
), dequeued AS (
    DELETE FROM queued_events
    WHERE id = %(event_id)s::int4 AND EXISTS (SELECT 1 FROM go)
    RETURNING 1
), message AS (
    INSERT INTO messages ({_MESSAGE_COLUMNS})
    SELECT {_MESSAGE_VALUES}
    WHERE %(has_message)s::bool AND EXISTS (SELECT 1 FROM go)
    RETURNING 1
)
SELECT (SELECT count(*) FROM go), (SELECT count(*) FROM marker), (SELECT count(*) FROM fenced)
"""
"""The start of a turn; returns (went ahead, marker rows written, lease held): (0, 0, 1) for a
redelivery or a queued event another process has run already, (0, 0, 0) when the lease was
lost."""

QUEUE_EVENT = """
WITH seen AS (
    INSERT INTO seen_messages (session_key, message_id, seen_at)
    SELECT %(session_key)s::text, %(seen)s::text, %(enqueued_at)s::float8
    WHERE %(seen)s::text IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING 1
)
INSERT INTO queued_events
    (session_key, internal, bound_session_id, event_json, enqueued_at, updated_at)
SELECT %(session_key)s::text, %(internal)s::int4, %(bound_session_id)s::text,
    %(event_json)s::text, %(enqueued_at)s::float8, %(updated_at)s::float8
WHERE %(seen)s::text IS NULL OR EXISTS (SELECT 1 FROM seen)
RETURNING id
"""
"""A queued event and, for a human one (``seen``: its platform message id), the message
recorded as seen on the lane; returns the event's id, or nothing (nothing written) when the
message was seen there before."""

_OBLIGATION_COLUMNS = tuple(Obligation.__dataclass_fields__)
_OBLIGATION_TYPES = {
    "attempts": "int4", "created_at": "float8", "updated_at": "float8",
    "lease_expires_at": "float8", "marked_sends": "int4",
}  # fmt: skip
_OBLIGATION_VALUES = ", ".join(
    f"%(o_{name})s::{_OBLIGATION_TYPES.get(name, 'text')}" for name in _OBLIGATION_COLUMNS
)

FINISH_TURN = f"""
WITH {_fenced("%(o_session_key)s::text")}, message AS (
    INSERT INTO messages ({_MESSAGE_COLUMNS})
    SELECT {_MESSAGE_VALUES}
    WHERE %(has_message)s::bool AND EXISTS (SELECT 1 FROM fenced)
    RETURNING 1
), owed AS (
    INSERT INTO delivery_obligations ({", ".join(_OBLIGATION_COLUMNS)})
    SELECT {_OBLIGATION_VALUES} WHERE EXISTS (SELECT 1 FROM fenced)
    ON CONFLICT (obligation_id) DO NOTHING
    RETURNING 1
), cleared AS (
    UPDATE gateway_routing
    SET active_turn_token = NULL, active_turn_started_at = NULL,
        updated_at = %(updated_at)s::float8, revision = revision + 1,
        entry_json = COALESCE(%(entry_json)s::text, entry_json)
    WHERE session_key = %(session_key)s::text AND active_turn_token = %(token)s::text
        AND EXISTS (SELECT 1 FROM fenced)
    RETURNING 1
)
SELECT (SELECT count(*) FROM owed), (SELECT count(*) FROM cleared), (SELECT count(*) FROM fenced)
"""
"""A turn's reply, its ledger row and the marker cleared; returns (row new, marker cleared,
lease held); nothing is written when the lease was lost."""


_CASTS = {str: "text", int: "int4", float: "float8"}
_SESSION_VALUES = ", ".join(
    f"%(s_{column.name})s::{_CASTS[column.type.python_type]}" for column in sessions.c
)


@functools.cache
def create_session(route: str) -> str:
    """A new session in one round trip: ``route`` (the routing row's write, as
    ``RoutingRows.route_write`` chose it) and, only if it wrote the row, the predecessor's
    end (``e_id``, ``e_reason``, ``e_at``) and the new session row (``s_<column>``). Returns
    the routing rows written (0: a checked write found the row changed; nothing was written).
    The insert counts ``ended`` first, so the predecessor has ended before the new row goes in
    (a key has one open session at most, by a unique index)."""
    return f"""
WITH route AS (
{route}
RETURNING 1
), ended AS (
    UPDATE sessions SET ended_at = %(e_at)s::float8, end_reason = %(e_reason)s::text
    WHERE id = %(e_id)s::text AND ended_at IS NULL AND EXISTS (SELECT 1 FROM route)
    RETURNING 1
), created AS (
    INSERT INTO sessions ({", ".join(column.name for column in sessions.c)})
    SELECT {_SESSION_VALUES}
    WHERE EXISTS (SELECT 1 FROM route) AND (SELECT count(*) FROM ended) >= 0
)
SELECT count(*) FROM route
"""


def message_params(row: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``m_*`` parameters of a message row (absent: ``has_message`` false)."""
    params = {f"m_{name}": None if row is None else row[name] for name in MESSAGE_INSERT_COLUMNS}
    params["has_message"] = row is not None
    return params


def obligation_params(obligation: Obligation) -> dict[str, Any]:
    """The ``o_*`` parameters of a ledger row."""
    return {f"o_{name}": getattr(obligation, name) for name in _OBLIGATION_COLUMNS}
