"""Conversions between store values and SQL rows (shared by the SQL backend's parts)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from hermes_core.errors import InvalidValueError
from hermes_core.store.backend import MESSAGE_COLUMNS, MESSAGE_ROLES, EntryDict, Message, SessionRow

SESSION_COLUMNS = tuple(SessionRow.__dataclass_fields__)


def epoch(stamp: object) -> float | None:
    """Epoch seconds of an ISO entry time (None stays None)."""
    return datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None


def message_row(session_id: str, message: Message) -> dict[str, Any]:
    """A transcript message as column values; unknown keys go to ``extra_json``."""
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        allowed = ", ".join(sorted(MESSAGE_ROLES))
        raise InvalidValueError("role", f"message role {role!r} is not one of: {allowed}.")
    stamp = message.get("timestamp")
    if stamp is None:
        stamp = time.time()
    elif isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise InvalidValueError("timestamp", "message timestamp must be epoch seconds (a number).")
    content = message.get("content")
    extras = {k: v for k, v in message.items() if k not in MESSAGE_COLUMNS and k != "id"}
    if content is not None and not isinstance(content, str):
        extras["content"] = content  # structured content round-trips through extra_json
        content = None
    tool_calls = message.get("tool_calls")
    row = {name: message.get(name) for name in MESSAGE_COLUMNS}
    row.update(
        session_id=session_id,
        content=content,
        timestamp=float(stamp),
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
    """Column copies of an entry beside its authoritative ``entry_json``."""
    return {
        "session_key": entry["session_key"],
        "session_id": entry["session_id"],
        "updated_at": epoch(entry["updated_at"]),
        "suspended": int(bool(entry.get("suspended"))),
        "resume_pending": int(bool(entry.get("resume_pending"))),
        "active_turn_token": entry.get("active_turn_token"),
        "entry_json": json.dumps(entry, ensure_ascii=False, separators=(",", ":")),
    }
