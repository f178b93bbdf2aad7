"""Session context for the system prompt (SPEC §5, §9)."""

from __future__ import annotations

_SESSION_TYPE_LINE = (
    "**Session type:** Multi-user {kind} — messages are prefixed with [sender name]. "
    "Multiple users may participate."
)


def session_type_line(*, thread: bool) -> str:
    """The prompt line of a shared session (SPEC §5); it names no user, so the prompt stays
    identical across turns (prompt caching). ``thread``: the key has an effective thread."""
    return _SESSION_TYPE_LINE.format(kind="thread" if thread else "session")
