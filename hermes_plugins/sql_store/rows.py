"""Conversions between store values and SQL rows (shared by the SQL backend's parts)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from hermes_core.domain.errors import shown
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.timeutil import format_utc, parse_utc
from hermes_core.store.backend import (
    MESSAGE_COLUMNS,
    EntryDict,
    Message,
    SessionRow,
    clean_message,
)
from hermes_plugins.sql_store.schema import gateway_routing

SESSION_COLUMNS = tuple(SessionRow.__dataclass_fields__)
FIRST_REVISIONS = 2**30
"""A new routing row's revision is drawn from 1 to this; the column (32-bit) then has room for
at least as many writes of the row."""
ROUTE_READ = tuple(
    gateway_routing.c[name]
    for name in (
        "entry_json", "updated_at", "active_turn_token", "active_turn_started_at", "revision",
    )
)  # fmt: skip
"""What a routing entry is read from (see :func:`route_entry`), with the row's revision."""
_NO_VALUES = dict.fromkeys(MESSAGE_COLUMNS)
"""A message row's columns, all None (a message's own values then replace them, in place)."""


def epoch(stamp: object) -> float | None:
    """Epoch seconds of an ISO entry time (None stays None)."""
    return datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None


def message_row(session_id: str, message: Message) -> dict[str, Any]:
    """A transcript message as column values (:func:`clean_message` first); unknown keys go to
    ``extra_json``."""
    row = {**_NO_VALUES, **clean_message(message)}
    extras: dict[str, Any] = {}
    if len(row) > len(_NO_VALUES):  # fields without a column follow, in the message's order
        for name in list(row)[len(_NO_VALUES) :]:
            value = row.pop(name)
            if name != "id":  # the id of a stored message, never stored again
                extras[name] = value
    content = row["content"]
    if content is not None and not isinstance(content, str):
        extras["content"] = content  # structured content round-trips through extra_json
        content = None
    tool_calls = row["tool_calls"]
    row.update(
        session_id=session_id,
        content=content,
        tool_calls=None if tool_calls is None else json.dumps(tool_calls, ensure_ascii=False),
        extra_json=json.dumps(extras, ensure_ascii=False) if extras else None,
    )
    return row


def message_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stored message as the mapping ``load_transcript`` returns (with its ``id``)."""
    message: dict[str, Any] = {"id": row["id"]}
    for name in MESSAGE_COLUMNS:
        value = row[name]
        if value is not None:
            message[name] = json.loads(value) if name == "tool_calls" else value
    if row["extra_json"]:
        message.update(json.loads(row["extra_json"]))
    return message


def session_values(row: SessionRow) -> dict[str, Any]:
    """Column values of a session row."""
    values = {name: getattr(row, name) for name in SESSION_COLUMNS}
    values["expiry_finalized"] = int(row.expiry_finalized)
    return values


def route_params(entry: EntryDict) -> dict[str, Any]:
    """A routing row: ``entry_json`` and the columns queries need. The turn marker and the
    activity time are authoritative in their columns (a turn updates only those). ``revision``
    is the row's first if the write inserts it: random, so that a row pruned and created again
    does not count up through the revisions of the row it replaces, which another process may
    still hold a cached copy of (a checked write from that copy must fail, not match)."""
    return {
        "revision": 1 + secrets.randbelow(FIRST_REVISIONS),
        "session_key": entry["session_key"],
        "session_id": entry["session_id"],
        "updated_at": epoch(entry["updated_at"]),
        "suspended": int(bool(entry.get("suspended"))),
        "resume_pending": int(bool(entry.get("resume_pending"))),
        "active_turn_token": entry.get("active_turn_token"),
        "active_turn_started_at": epoch(entry.get("active_turn_started_at")),
        "entry_json": entry_text(entry),
    }


def entry_text(entry: EntryDict) -> str:
    """A routing entry as its ``entry_json`` column holds it."""
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def marker_params(entry: SessionEntry, *, rewrite: bool = False) -> dict[str, Any]:
    """The columns a turn's start or end writes: marker token and start, activity time and,
    with ``rewrite`` (its metadata changed too: see ``STREAM_METADATA``), ``entry_json``
    (None: the stored one is kept)."""
    started = entry.active_turn_started_at
    return {
        "session_key": entry.session_key,
        "active_turn_token": entry.active_turn_token,
        "active_turn_started_at": started.timestamp() if started is not None else None,
        "updated_at": entry.updated_at.timestamp(),
        "entry_json": entry_text(entry.to_dict()) if rewrite else None,
    }


def route_entry(row: Mapping[Any, Any]) -> dict[str, Any]:
    """A stored routing row (the :data:`ROUTE_READ` columns) as an entry mapping:
    ``entry_json`` with the marker and the activity time of their columns.

    Junk never raises here (one bad row must not stop a listing): ``entry_json`` that is not a
    JSON object gives ``{}``, which the store skips with a warning; a time column that is not
    a time leaves the entry's own value. :func:`route_problems` names both for ``doctor``."""
    entry = json_object(row["entry_json"])
    if entry is None:
        return {}
    entry["active_turn_token"] = row["active_turn_token"]
    if row["active_turn_started_at"] is None:
        entry["active_turn_started_at"] = None
    for column in ("updated_at", "active_turn_started_at"):
        stamp = _iso(row[column])
        if stamp is not None:
            entry[column] = stamp
    return entry


def route_problems(row: Mapping[Any, Any]) -> list[str]:
    """What in a routing row (its ``entry_json`` and time columns) :func:`route_entry` had to
    pass over: an entry that is not a JSON object, a time that is not one."""
    problems = []
    entry = route_entry(row)
    if not entry:
        problems.append("its entry_json is not a JSON object")
    for name in ("session_id", "created_at", "updated_at") if entry else ():
        if parse_utc(entry.get(name)) is None and not (
            name == "session_id" and isinstance(entry.get(name), str)
        ):
            problems.append(f"its entry has no valid {name}")
    for column in ("updated_at", "active_turn_started_at"):
        if row[column] is not None and _iso(row[column]) is None:
            problems.append(f"its {column} is not a time ({shown(row[column])})")
    return problems


def json_object(text: Any) -> dict[str, Any] | None:
    """A stored JSON column (``entry_json``, ``event_json``) as a mapping, or None when it is
    not a JSON object."""
    try:
        entry = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return entry if isinstance(entry, dict) else None


def session_row(row: Mapping[Any, Any]) -> SessionRow:
    """A ``sessions`` row as a :class:`SessionRow`."""
    values = {name: row[name] for name in SESSION_COLUMNS}
    values["expiry_finalized"] = bool(values["expiry_finalized"])
    return SessionRow(**values)


def _iso(stamp: Any) -> str | None:
    """An epoch column as the stored time form; None when it is no time (junk, NaN)."""
    try:
        return format_utc(datetime.fromtimestamp(stamp, timezone.utc))
    except (TypeError, ValueError, OverflowError, OSError):
        return None
