"""What the gateway says: every reply text here is an exact, observable contract."""

from __future__ import annotations

ACK_QUEUED = "⏳ Queued for the next turn. I'll respond once the current task finishes."
ACK_INTERRUPT = "⚡ Interrupting current task. I'll respond to your message shortly."
REFUSED_CAP = (
    "⚠️ Not queued — {n} messages are already waiting. Please resend this after the current task "
    "finishes."
)
REFUSED_FULL = (
    "⚠️ Not queued — too many messages are waiting on this gateway. Please resend this in a "
    "little while."
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
