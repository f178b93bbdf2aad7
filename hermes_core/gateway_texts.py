"""What the gateway says and which commands it understands.

Every reply text here is an exact, observable contract; the host's single-answer callbacks are
gathered in :class:`HostCallbacks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hermes_core.models import MessageEvent, SessionSource

ACK_QUEUED = "⏳ Queued for the next turn. I'll respond once the current task finishes."
ACK_INTERRUPT = "⚡ Interrupting current task. I'll respond to your message shortly."
REFUSED_CAP = (
    "⚠️ Not queued — {n} messages are already waiting. Please resend this after the current task "
    "finishes."
)
REFUSED_NOT_SAVED = "⚠️ Not queued — this message could not be saved. Please resend it."
NEW_SESSION = "✨ New session started."
SUSPENDED_NOTICE = (
    "♻️ The previous conversation here was suspended, so a new session has started. Earlier "
    "messages are kept in history."
)
DRAIN_QUEUED = {
    "restart": "⏳ Gateway restarting — queued for the next turn after it comes back.",
    "shutdown": "⏳ Gateway shutting down — queued for the next turn after it comes back.",
}
DRAIN_REFUSED = {
    "restart": "⏳ Gateway is restarting and is not accepting another turn right now.",
    "shutdown": "⏳ Gateway is shutting down and is not accepting another turn right now.",
}
STOPPED = "Stopped."
NOTHING_TO_STOP = "No active task to stop."
QUEUE_USAGE = "Usage: /queue <prompt>"
QUEUED_COMMAND = "Queued for the next turn."
TURN_FAILED = "⚠️ Something went wrong while answering; please try again."
ACK_INTERVAL_SECS = 30.0


@dataclass
class HostCallbacks:
    """The host's single-answer callbacks; each is optional."""

    interrupt_background: Callable[[str, str], object] | None = None
    """Stop the lane's background work (key, current session id); idempotent."""
    wake_allowed: Callable[[MessageEvent, str], bool] | None = None
    """May an internal wake bound to an older session run in the current one (event, id)?"""
    authorised: Callable[[SessionSource], bool] | None = None
    """Authorisation re-check of a resumed lane's sender."""
    diagnostic_muted: Callable[[str, str], bool] | None = None
    """Does the chat policy mute this diagnostic reply (key, text)?"""
    has_active_processes: Callable[[str], bool] | None = None
    """Does the lane have live background processes (never pruned)?"""


def parse_command(
    text: str, names: Sequence[str], *, bot_username: str | None, direct: bool
) -> tuple[str | None, str]:
    """The command a message starts with (first token, any case) and the rest of its text.

    A command addressed as ``/cmd@name`` counts only when it is addressed to this bot: ``name``
    equals ``bot_username`` (any case, as Telegram user names are), or, with no
    ``bot_username`` known, in a direct chat (``direct``), where no other bot can be meant. In a
    group it may be meant for another bot, so it stays ordinary text."""
    parts = text.strip().split(maxsplit=1)
    if not parts:
        return None, ""
    word, at, name = parts[0].partition("@")
    rest = parts[1] if len(parts) > 1 else ""
    if at and not (name.casefold() == bot_username.casefold() if bot_username else direct):
        return None, rest
    word = word.lower()
    return (word if word in names else None), rest
