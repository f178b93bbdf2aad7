"""The durable steps of one turn (SPEC §7.3, §7.5, §7.10-§7.12), shared by every runner.

``begin`` files the event under its session and stores the user message together with the turn
marker; the host runs the agent; ``finish`` stores the reply and records what is owed (clearing
the marker in the same commit); ``deliver`` sends it through the ledger; ``complete`` closes the
turn. Each step is synchronous (run it in a worker thread from asyncio) and passes the named
crash points, so a test can kill the process between any two of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hermes_core.config import GatewayConfig
from hermes_core.crashpoints import crash_point
from hermes_core.ledger import SILENCE_NOTICE, SendFunction, SendResult, is_silent_reply
from hermes_core.models import MessageEvent, SessionEntry
from hermes_core.recovery import INTERNAL_NOTIFICATION
from hermes_core.resume import is_fresh, resume_note
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation


@dataclass(frozen=True)
class Turn:
    """A turn in flight: its lane, its marker token and, for a resumed lane, the note."""

    event: MessageEvent
    entry: SessionEntry
    token: str
    note: str | None
    """The resume note (SPEC §7.10) when the lane resumes a fresh interruption."""

    def message(self, text: str) -> str:
        """What the agent receives: ``text`` (the event's, possibly sender-prefixed) after the
        resume note; a synthesized resume (empty internal event) is the note alone."""
        if self.note is None:
            return text
        if self.event.internal and not self.event.text:
            return self.note
        return f"{self.note}\n\n{text}"


@dataclass(frozen=True)
class Reply:
    """What a finished turn owes: the text to send and its ledger row (None without ledger)."""

    content: str
    obligation: Obligation | None


class TurnPipeline:
    """Durable turn steps over one store."""

    def __init__(self, store: SessionStore, config: GatewayConfig) -> None:
        self.store = store
        self.config = config
        self.counts = store.restart_counts()

    def begin(self, event: MessageEvent, consumed_event_id: int | None = None) -> Turn | None:
        """File the event and store its user message with a new turn marker (one commit).

        A lane that is ``resume_pending`` with a fresh interruption gets the resume note: before
        the user's text, or (for a synthesized, empty resume event) as the stored message.
        Returns None when the lane vanished under the call.
        """
        entry = self.store.get_or_create_session(event.source, touch_activity=not event.internal)
        if entry.was_auto_reset and entry.prev_session_id:
            self.counts.remove(entry.session_key)
        stored_text = event.text
        note = None
        if entry.resume_pending and self._interruption_fresh(entry):
            synthesized = event.internal and not event.text
            note = resume_note(entry.resume_reason, synthesized=synthesized)
            if synthesized:
                stored_text = note
        message: dict[str, object] = {"role": "user", "content": stored_text}
        if event.message_id:
            message["platform_message_id"] = event.message_id
        if event.internal:
            message["display_kind"] = INTERNAL_NOTIFICATION
        token = self.store.mark_turn_active(entry.session_key, consumed_event_id, message)
        if token is None:
            return None
        crash_point("marker_written")
        crash_point("user_stored")
        return Turn(event, entry, token, note)

    def _interruption_fresh(self, entry: SessionEntry) -> bool:
        row = self.store.session_row(entry.session_id)
        anchor = row.last_activity_at if row is not None else None
        return is_fresh(anchor, self.config.agent.gateway_auto_continue_freshness)

    def finish(self, turn: Turn, reply: str | None) -> Reply | None:
        """Store a successful turn's reply and record it for delivery (clearing the marker in
        the same commit). None when nothing is owed: an empty reply, or a machinery turn that
        ended silently."""
        if not reply:
            self.store.clear_turn_active(turn.entry.session_key, turn.token)
            return None
        session_id = turn.entry.session_id
        self.store.append_to_transcript(session_id, {"role": "assistant", "content": reply})
        crash_point("reply_stored")
        silent = is_silent_reply(reply)
        if silent and turn.event.internal:
            self.store.clear_turn_active(turn.entry.session_key, turn.token)
            return None
        content = SILENCE_NOTICE if silent else reply
        source = turn.event.source
        recorded = self.store.record_delivery_obligation(
            turn.entry.session_key, session_id, source.platform, source.chat_id,
            source.thread_id, content, turn.event.message_id or turn.token,
            reply_to_message_id=turn.event.message_id, turn_token=turn.token,
        )  # fmt: skip
        crash_point("obligation_recorded")
        if recorded is None:
            return Reply(content, None)
        now = time.time()
        row = Obligation(
            obligation_id=recorded, session_key=turn.entry.session_key, session_id=session_id,
            platform=source.platform, chat_id=source.chat_id, thread_id=source.thread_id,
            reply_to_message_id=turn.event.message_id, content=content, origin_kind="turn",
            state="pending", attempts=0, failure_kind=None, last_error=None, created_at=now,
            updated_at=now,
        )  # fmt: skip
        return Reply(content, row)

    def deliver(self, turn: Turn, reply: Reply, send: SendFunction) -> bool:
        """Send a finished turn's reply with a blocking send function: :meth:`claim`, send,
        :meth:`settle`."""
        if not self.claim(reply):
            return False
        try:
            result = send(self.addressed(turn, reply), reply.content)
        except Exception as exc:  # noqa: BLE001 - a raising adapter is a failed send
            result = SendResult(ok=False, failure_kind="disconnected", error=repr(exc))
        return self.settle(turn, reply, result)

    def claim(self, reply: Reply) -> bool:
        """Before the platform call: mark the ledger row ``attempting``; False when it has no
        attempt left (abandoned). A reply sent without the ledger needs no claim."""
        ledger = self.store.ledger
        if reply.obligation is None or ledger is None:
            return True
        return ledger.claim(reply.obligation)

    def settle(self, turn: Turn, reply: Reply, result: SendResult) -> bool:
        """After the platform call: settle the ledger row; without the ledger nothing more is
        owed, so the marker is cleared. True when the reply was delivered."""
        ledger = self.store.ledger
        if reply.obligation is not None and ledger is not None:
            return ledger.settle(reply.obligation, result)
        if result.ok:
            crash_point("sent")
        self.store.clear_turn_active(turn.entry.session_key, turn.token)
        return result.ok

    @staticmethod
    def addressed(turn: Turn, reply: Reply) -> Obligation:
        """Where the reply goes: its ledger row, or an equivalent record without the ledger."""
        return (
            reply.obligation if reply.obligation is not None else _unrecorded(turn, reply.content)
        )

    def complete(self, turn: Turn, *, success: bool) -> None:
        """Close the turn: clear its marker if still set; after a success also the resume flag
        and the lane's stuck-loop count (failed turns keep the flag, SPEC §7.11)."""
        key = turn.entry.session_key
        self.store.clear_turn_active(key, turn.token)
        if success:
            self.store.clear_resume_pending(key)
            self.counts.remove(key)
        crash_point("marker_cleared")

    def run(
        self, event: MessageEvent, agent: Callable[[Turn], str | None], send: SendFunction
    ) -> bool:
        """One whole turn with a synchronous agent; True when it succeeded."""
        turn = self.begin(event)
        if turn is None:
            return False
        try:
            reply_text = agent(turn)
        except Exception:
            self.complete(turn, success=False)
            raise
        reply = self.finish(turn, reply_text)
        if reply is not None:
            self.deliver(turn, reply, send)
        self.complete(turn, success=True)
        return True


def _unrecorded(turn: Turn, content: str) -> Obligation:
    """A ledger-shaped record for a reply sent without the ledger (for the send function)."""
    source = turn.event.source
    now = time.time()
    return Obligation(
        obligation_id="", session_key=turn.entry.session_key, session_id=turn.entry.session_id,
        platform=source.platform, chat_id=source.chat_id, thread_id=source.thread_id,
        reply_to_message_id=turn.event.message_id, content=content, origin_kind="turn",
        state="pending", attempts=0, failure_kind=None, last_error=None, created_at=now,
        updated_at=now,
    )  # fmt: skip
