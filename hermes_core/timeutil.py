"""Time helpers: every persisted time is timezone-aware UTC."""

from __future__ import annotations

from datetime import datetime, timezone


def utc_now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


def to_utc(value: datetime) -> datetime:
    """Convert to aware UTC; a naive value (older writers) is host-local time."""
    return value.astimezone(timezone.utc)


def format_utc(value: datetime) -> str:
    """ISO 8601 with microseconds and offset ``+00:00``, the stored form of every datetime."""
    return to_utc(value).isoformat(timespec="microseconds")


def parse_utc(value: object) -> datetime | None:
    """Parse a stored datetime (``datetime`` or ISO string, ``Z`` allowed); None when malformed."""
    try:
        if isinstance(value, datetime):
            return to_utc(value)
        if not isinstance(value, str) or not value.strip():
            return None
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        return to_utc(datetime.fromisoformat(text))
    except (ValueError, OverflowError, OSError):
        return None
