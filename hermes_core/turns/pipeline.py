"""The durable steps of one turn: three commits per turn.

1. :meth:`TurnPipeline.begin`: the lane's session (created or reopened if needed), the turn
   marker, the user message, the removal of the queued event and the platform message id as seen,
   in one commit; the lane's activity is touched in the same write.
2. :meth:`TurnPipeline.finish`: the reply, its ledger row recorded already claimed
   (``attempting``) and the marker cleared, in one commit (one statement on PostgreSQL).
3. :meth:`TurnPipeline.settle`: the ledger row settled and, after a successful turn, the resume
   flag and the stuck-loop count cleared where set, in one commit; on a shared store the lane's
   lease is given up in it when nothing else waits for the lane.

Each step is a function for the store's writer (``await store.arun(pipeline.begin, ...)``): it
runs on the writer thread, where concurrent lanes' steps share a commit. The runtime passes the
crash points after each step returns, that is after its commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import MessageRedeliveredError
from hermes_core.domain.models import MessageEvent, SessionEntry
from hermes_core.domain.text import clean_text
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation, new_obligation
from hermes_core.store.queue_rows import QueuedEvent
from hermes_core.turns.ledger import SILENCE_NOTICE, SendResult, is_silent_reply
from hermes_core.turns.recovery import INTERNAL_NOTIFICATION
from hermes_core.turns.resume import is_fresh, resume_note


@dataclass(frozen=True)
class Turn:
    """A turn in flight: its lane, its marker token and, for a resumed lane, the note."""

    event: MessageEvent
    entry: SessionEntry
    token: str
    note: str | None
    """The resume note when the lane resumes a fresh interruption."""
    suspended_before: bool = False
    """The lane was suspended: this turn opened a new session (the sender is told)."""

    @property
    def key(self) -> str:
        """The lane's session key."""
        return self.entry.session_key

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
    """What a finished turn owes: its text and its ledger row (without the ledger, a row with
    an empty id that addresses the chat)."""

    content: str
    row: Obligation

    @property
    def ledgered(self) -> bool:
        """Whether the reply has a ledger row (the ledger is on and recording worked)."""
        return bool(self.row.obligation_id)


class TurnPipeline:
    """The three commits of a turn over one store (functions for ``store.arun``)."""

    def __init__(
        self,
        store: SessionStore,
        config: GatewayConfig,
        streams_to: Callable[[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self._streams_to = streams_to
        """Whether a platform's replies are shown as they grow (the turn's start records that
        a streamed reply may be under way: see ``STREAM_METADATA``)."""

    def begin(
        self, key: str, event: MessageEvent, consumed_event_id: int | None = None
    ) -> Turn | None:
        """Start a turn (commit 1). None when the lane's platform message was stored before
        (a redelivery: nothing is written, the queued event stays to be discarded by the
        caller) or the lane vanished under the call.

        A lane that is ``resume_pending`` with a fresh interruption gets the resume note: before
        the user's text, or (for a synthesized, empty resume event) as the stored message.
        """
        store = self.store
        entry, suspended = store._sessions.open_lane(key, event.source)
        if entry.was_auto_reset and entry.prev_session_id:
            store._counts.current.remove(key)
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
        human = event.message_id and not event.internal
        # A queued event's message id was recorded as seen when it was queued.
        seen = str(event.message_id) if human and consumed_event_id is None else None
        try:
            stream = self._streams_to is not None and self._streams_to(event.source.platform)
            token = store._turns.mark_turn_active(
                key, consumed_event_id, message, seen=seen, touch=not event.internal, stream=stream
            )
        except MessageRedeliveredError:
            return None
        if token is None:
            return None
        return Turn(event, entry, token, note, suspended)

    def _interruption_fresh(self, entry: SessionEntry) -> bool:
        row = self.store.session_row(entry.session_id)
        anchor = row.last_activity_at if row is not None else None
        return is_fresh(anchor, self.config.agent.gateway_auto_continue_freshness)

    def finish(
        self, turn: Turn, reply: str | None, success: bool, stream_messages: str | None = None
    ) -> Reply | None:
        """Store the reply and record it for delivery, claimed, clearing the marker (commit 2);
        ``stream_messages``: the platform messages it was streamed into (the row keeps them).

        None when nothing is to be sent: no reply, or a machinery turn that ended silently;
        the turn is then closed in this same commit.
        """
        store, key = self.store, turn.key
        if not reply:
            store._turns.close_turn(key, turn.token, success=success)
            return None
        reply = clean_text(reply)  # sent as it is stored, whatever the agent returned
        session_id = turn.entry.session_id
        message = {"role": "assistant", "content": reply}
        silent = is_silent_reply(reply)
        if silent and turn.event.internal:
            store.append_to_transcript(session_id, message)
            store._turns.close_turn(key, turn.token, success=success)
            return None
        content = SILENCE_NOTICE if silent else reply
        source = turn.event.source
        row = store._turns.record_delivery_obligation(
            key, session_id, source.platform, source.chat_id, source.thread_id, content,
            turn.event.message_id or turn.token, reply_to_message_id=turn.event.message_id,
            turn_token=turn.token, claimed=True, reply=message, stream_messages=stream_messages,
        )  # fmt: skip
        if row is None:  # no ledger: the reply alone; the marker stays until the send settles
            store.append_to_transcript(session_id, message)
            row = new_obligation(
                key, session_id, source.platform, source.chat_id, source.thread_id,
                turn.event.message_id, content,
            )  # fmt: skip
        return Reply(content, row)

    def settle(
        self,
        row: Obligation,
        result: SendResult,
        turn: Turn | None,
        success: bool = True,
        close: bool = False,
        kept: Callable[[list[QueuedEvent]], object] | None = None,
    ) -> bool:
        """After a send attempt (commit 3): settle the ledger row and close the turn; a reply
        sent outside a turn clears its lane's resume flag with ``close`` (the boot sweep: the
        interrupted turn is answered, not to be run again); on a shared store, given ``kept``
        (a turn's settle), the lane's lease is given up in the same statement as the settle,
        unless events wait in the lane's durable queue: then ``kept`` gets them. True when it
        was delivered."""
        closing: tuple[str, str | None] | None = None
        if turn is not None:
            closing = (turn.key, turn.token)
        elif close:
            closing = (row.session_key, None)
        return self.store._turns.settle_delivery(row, result, closing, success=success, kept=kept)
