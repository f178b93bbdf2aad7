"""Auto-resume after a restart and the resume note of the next turn."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from datetime import datetime, timezone

from hermes_core.domain.errors import InvalidValueError
from hermes_core.domain.models import MessageEvent, MessageType, SessionEntry, SessionSource
from hermes_core.domain.timeutil import parse_utc, to_utc, utc_now
from hermes_core.store import SessionStore
from hermes_core.store.turns import AUTO_RESUME_REASONS

_NOTE_START = "[System note: Your previous turn was interrupted by {reason} before it finished."
_NOTE_WITH_TEXT = (
    " The conversation history above is intact. Respond to the NEW message below first; do not "
    "repeat tool calls from the interrupted turn unless the user asks, and never re-execute a "
    "restart or shutdown command.]"
)
_NOTE_SYNTHESIZED = (
    " The conversation history above is intact. Continue the interrupted task now instead of "
    "only acknowledging that the session was restored. Tool calls in the history without a "
    "result have an UNKNOWN effect: check their effect before repeating them, and never "
    "re-execute a restart or shutdown command.]"
)
_REASON_WORDS = {"restart_timeout": "a gateway restart", "shutdown_timeout": "a gateway shutdown"}


def resume_note(reason: str | None, *, synthesized: bool) -> str:
    """The exact note prepended to the next turn of a resumed lane (never the system prompt)."""
    words = _REASON_WORDS.get(reason or "", "a gateway interruption")
    return _NOTE_START.format(reason=words) + (
        _NOTE_SYNTHESIZED if synthesized else _NOTE_WITH_TEXT
    )


def freshness_epoch(value: object) -> float | None:
    """A freshness timestamp as epoch seconds: datetimes (naive = host local), epoch seconds,
    epoch milliseconds (> 10^10), ISO strings (``Z`` allowed) and numeric strings; booleans and
    anything else are unknown (None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, datetime):
        return to_utc(value).timestamp()
    number: float | None = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            parsed = parse_utc(value)
            return parsed.timestamp() if parsed is not None else None
    if number is None or not math.isfinite(number):
        return None
    return number / 1000 if number > 1e10 else number


def is_fresh(anchor: object, window: float, now: float | None = None) -> bool:
    """Whether an interruption anchored at ``anchor`` is within ``window`` seconds (equal age is
    fresh; a window <= 0 makes everything fresh; an unknown anchor is fresh)."""
    if window <= 0:
        return True
    stamp = freshness_epoch(anchor)
    if stamp is None:
        return True
    current = utc_now().timestamp() if now is None else now
    return current - stamp <= window


def resume_candidates(
    store: SessionStore,
    window: float,
    *,
    platform: str | None = None,
    connected: Callable[[str], bool] = lambda _platform: True,
    busy: Callable[[str], bool] = lambda _key: False,
    authorised: Callable[[SessionSource], bool] | None = None,
) -> list[SessionEntry]:
    """Lanes to auto-resume: ``resume_pending`` with an auto-resume reason, not
    suspended, with an origin (on ``platform`` if given), anchored (``last_resume_marked_at``,
    else ``updated_at``) within the freshness window, idle, on a connected platform, and whose
    sender passes the host's authorisation re-check."""
    check = functools.partial(
        resumable, store=store, window=window, platform=platform, connected=connected,
        busy=busy, authorised=authorised,
    )  # fmt: skip
    return [entry for entry in store.list_sessions(resume_pending=True) if check(entry)]


def resumable(
    entry: SessionEntry,
    store: SessionStore,
    window: float,
    *,
    platform: str | None = None,
    connected: Callable[[str], bool] = lambda _platform: True,
    busy: Callable[[str], bool] = lambda _key: False,
    authorised: Callable[[SessionSource], bool] | None = None,
) -> bool:
    """Whether one lane is to auto-resume now (see :func:`resume_candidates`)."""
    origin = entry.origin
    if (
        not entry.resume_pending
        or entry.suspended
        or origin is None
        or entry.resume_reason not in AUTO_RESUME_REASONS
        or (platform is not None and origin.platform != platform)
    ):
        return False
    anchor = entry.last_resume_marked_at or entry.updated_at
    if not is_fresh(anchor, window) or busy(entry.session_key):
        return False
    if not store._leases.holds(entry.session_key):  # a shared store's lane run elsewhere
        return False
    return connected(origin.platform) and (authorised is None or authorised(origin))


def resume_event(entry: SessionEntry) -> MessageEvent:
    """The internal, empty event that resumes a lane (touching no activity when dispatched)."""
    if entry.origin is None:
        raise InvalidValueError("origin", f"{entry.session_key} has no origin to resume into.")
    return MessageEvent(
        source=entry.origin,
        text="",
        message_type=MessageType.TEXT,
        internal=True,
        bound_session_id=entry.session_id,
        received_at=datetime.now(timezone.utc),
        metadata={"resume": True, "resume_reason": entry.resume_reason},
    )
