"""Time helpers: every persisted time is timezone-aware UTC."""

from __future__ import annotations

import math
from datetime import datetime, timezone

from hermes_core.domain.errors import InvalidValueError

MAX_SPAN_DAYS = 36_500
"""The longest time span a caller may give (about a century): beyond it date arithmetic
overflows, and no lane is that old."""
_PER_DAY = {"days": 1, "hours": 24, "minutes": 1440}


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


def checked_span(value: object, name: str, unit: str = "days") -> float:
    """``value``, a time span in ``unit`` (days, hours or minutes) that a user gave, when it is a
    finite number above 0 and at most :data:`MAX_SPAN_DAYS`; else :class:`InvalidValueError`
    naming ``name``. NaN passes comparisons (``nan <= 0`` is false) and PostgreSQL sorts it above
    every number, so every span from outside goes through here."""
    limit = MAX_SPAN_DAYS * _PER_DAY[unit]
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or not 0 < number <= limit:
        shown = value if number is not None else type(value).__name__
        raise InvalidValueError(
            name, f"{name} must be a number of {unit} above 0 and at most {limit}, not {shown}."
        )
    return float(number)
