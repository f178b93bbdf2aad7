"""A turn's writes to the store (its marker, its reply recorded in the ledger, its settling)
and, after a restart, the markers a dead process left.

A marker set by ``mark_turn_active`` is the only evidence that a turn was interrupted; after a
restart the markers left by a dead process become ``resume_pending`` lanes (or are discarded
after a clean stop). A reply is recorded in the ledger before its first send, clearing the
marker in the same commit, and settled after it. On a shared store every write of a turn is
fenced by the lane's lease, and recovery touches only the lanes this process holds (start-up
takes the leases of lanes no live process holds first), or the ``lanes`` given.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hermes_core.domain.errors import LeaseLostError, MessageRedeliveredError, StoreError
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.text import clean_text
from hermes_core.domain.timeutil import utc_now
from hermes_core.store.backend import (
    LOCKED,
    STREAM_METADATA,
    Message,
    Obligation,
    new_obligation,
)
from hermes_core.store.backing import Backing
from hermes_core.store.base import changed, serialised
from hermes_core.store.counts import RestartCountStore
from hermes_core.store.leases import UNFENCED, Leases
from hermes_core.store.obligations import Obligations
from hermes_core.store.queue_rows import QueuedEvent
from hermes_core.store.routing import RoutingTable
from hermes_core.store.sessions import Sessions
from hermes_core.store.writer import StoreWriter
from hermes_core.turns.ledger import SendResult, obligation_id

logger = logging.getLogger(__name__)

AUTO_RESUME_REASONS = frozenset({"restart_timeout", "shutdown_timeout", "restart_interrupted"})
_CLEARED_MARKER = {"active_turn_token": None, "active_turn_started_at": None}


def _ended(entry: SessionEntry) -> tuple[SessionEntry, bool]:
    """``entry`` with its marker cleared at the end of its turn, and whether its metadata
    changed too: a streamed reply's record (:data:`STREAM_METADATA`) ends with the turn."""
    if STREAM_METADATA not in entry.metadata:
        return changed(entry, _CLEARED_MARKER), False
    metadata = {name: value for name, value in entry.metadata.items() if name != STREAM_METADATA}
    return changed(entry, _CLEARED_MARKER | {"metadata": metadata}), True


@dataclass(frozen=True)
class MarkerRecovery:
    """What ``recover_turn_markers`` did, by session key."""

    armed: tuple[str, ...] = ()
    """Lanes newly marked ``resume_pending`` (``restart_interrupted``)."""
    kept: tuple[str, ...] = ()
    """Lanes already ``resume_pending`` with a fresh marker (their reason kept)."""
    cleared: int = 0
    """Markers cleared in all, stale ones and suspended lanes' included."""

    @property
    def struck(self) -> tuple[str, ...]:
        """Lanes this start found interrupted: they count towards stuck-loop suspension."""
        return self.armed + self.kept


class Turns:
    """A turn's start, reply and end on its lane, and marker recovery after a restart."""

    def __init__(
        self,
        backing: Backing,
        routes: RoutingTable,
        writer: StoreWriter,
        sessions: Sessions,
        leases: Leases,
        obligations: Obligations,
        counts: RestartCountStore,
    ) -> None:
        self._backing = backing
        self._routes = routes
        self._writer = writer
        self._sessions = sessions
        self._leases = leases
        self._obligations = obligations
        self._counts = counts

    @serialised
    def mark_turn_active(
        self,
        session_key: str,
        consumed_event_id: int | None = None,
        user_message: Message | None = None,
        *,
        seen: str | None = None,
        touch: bool = False,
        stream: bool = False,
    ) -> str | None:
        """Persist a new turn marker and, in the same commit, the dequeue of
        ``consumed_event_id``, the user message, ``seen`` (its platform message id) as seen on
        the lane and, with ``touch``, the lane's activity; with ``stream`` (its reply may be
        shown as it grows), the record that a streamed reply is under way
        (:data:`STREAM_METADATA`, no messages yet) unless the lane holds one (a stream its last
        turn left cut, which the turn marks first). Returns the marker token, or None for an
        unknown key; raises :class:`MessageRedeliveredError` (nothing written) when ``seen``
        was seen on the lane before."""
        entry = self._routes.load(session_key)
        if entry is None:
            return None
        token = secrets.token_hex(16)
        now = utc_now()
        changes: dict[str, Any] = {"active_turn_token": token, "active_turn_started_at": now}
        if touch:
            changes["updated_at"] = now
        rewrite = stream and STREAM_METADATA not in entry.metadata
        if rewrite:
            changes["metadata"] = entry.metadata | {STREAM_METADATA: {"messages": []}}
        updated = changed(entry, changes)
        message = (entry.session_id, user_message) if user_message is not None else None
        # one backend write: its own transaction, fenced in its own statement
        with self._backing.canonical, self._leases.fenced(session_key) as fence:
            begun = self._backing.backend.begin_turn(
                updated, consumed_event_id, message, seen, **fence, rewrite=rewrite
            )
        if not begun:
            raise MessageRedeliveredError("the platform delivered this message again")
        self._routes.changed()
        self._routes.remember(updated, self._routes.bumped(session_key))
        self._routes.notify("turn_started", updated, token=token)
        return token

    @serialised
    def clear_turn_active(self, session_key: str, token: str) -> bool:
        """Compare-and-swap: clear the marker iff ``token`` still owns it."""
        entry = self._routes.load(session_key)
        if entry is None or entry.active_turn_token != token:
            return False
        updated, rewrite = _ended(entry)
        with self._backing.canonical, self._backing.backend.transaction():
            self._leases.fence(session_key)
            cleared = self._backing.backend.clear_turn_marker(updated, token, rewrite=rewrite)
        if not cleared:
            self._routes.forget(session_key)  # someone else owns the row now: reload next time
            return False
        self._routes.changed()
        self._routes.remember(updated, self._routes.bumped(session_key))
        self._routes.notify("turn_ended", updated, token=token)
        return True

    @serialised
    def settle_delivery(
        self,
        row: Obligation,
        result: SendResult,
        close: tuple[str, str | None] | None = None,
        *,
        success: bool = True,
        kept: Callable[[list[QueuedEvent]], object] | None = None,
    ) -> bool:
        """After a send attempt, in one commit: end the lane's turn with ``close`` = (session
        key, turn token) (its marker if still set and, after a ``success``, the resume flag and
        stuck-loop count where set), settle the ledger row (none without the ledger) and, given
        ``kept``, give up the lane's lease as :meth:`release_lease` does (a delivered reply's
        row goes in the same statement); events waiting in the lane's durable queue keep it
        and go to ``kept``. True when the platform accepted the reply."""
        ledger = self._obligations.ledger
        delivered = result.ok
        lane = row.session_key
        if close is not None:
            self.close_turn(*close, success=success)
        release = None
        if kept is not None and self._leases.shared and self._leases.holds(lane):
            release = functools.partial(self._release, lane, kept)
        if ledger is not None and row.obligation_id:
            delete = None
            if release is not None and delivered:
                delete, release = release, None
            delivered = ledger.settle(row, result, delete)
        if release is not None:
            release()
        return delivered

    def _release(
        self,
        session_key: str,
        kept: Callable[[list[QueuedEvent]], object],
        delivered: str | None = None,
    ) -> None:
        waiting = self._leases.release_lease(session_key, delivered=delivered)
        if waiting is not None and waiting != LOCKED:  # locked: kept, released later
            kept(waiting)

    @serialised
    def close_turn(self, session_key: str, token: str | None, *, success: bool = True) -> None:
        """End a turn: clear its marker if ``token`` still owns it; after a success also the
        resume flag and the stuck-loop count, each only where set (failed turns keep the flag).
        Writes nothing that would not change."""
        entry = self._routes.load(session_key) if token is not None or success else None
        if token is not None and entry is not None and entry.active_turn_token == token:
            self.clear_turn_active(session_key, token)  # a turn's reply usually cleared it
            entry = self._routes.load(session_key)
        if success:
            if entry is not None and entry.resume_pending:
                self._sessions.clear_resume_pending(session_key)
            self._counts.current.remove(session_key)

    @serialised
    def record_delivery_obligation(
        self,
        session_key: str,
        session_id: str | None,
        platform: str,
        chat_id: str | None,
        thread_id: str | None,
        content: str,
        message_ref: str,
        reply_to_message_id: str | None = None,
        turn_token: str | None = None,
        *,
        origin_kind: str = "turn",
        claimed: bool = False,
        reply: Message | None = None,
        stream_messages: str | None = None,
    ) -> Obligation | None:
        """Record a reply before its first send; with ``turn_token`` the lane's
        marker is cleared in the same commit (and its streamed reply's record, whose
        ``stream_messages`` the row takes over); ``claimed`` records it already ``attempting``
        (the send follows at once, so the claim needs no commit of its own); ``reply``, the
        reply's transcript message, is stored in the same commit too. Returns the row, or None
        when the ledger is off or failed (logged: a ledger failure never blocks a send; the
        caller then stores ``reply`` itself). ``content`` is stored (and to be sent) as
        :func:`~hermes_core.domain.text.clean_text` has it."""
        ledger = self._obligations.ledger
        if ledger is None:
            return None
        content = clean_text(content)  # what is sent is what is stored
        record = new_obligation(
            session_key, session_id, platform, chat_id, thread_id, reply_to_message_id, content,
            obligation_id=obligation_id(session_key, message_ref, content),
            origin_kind=origin_kind, stream_messages=stream_messages,
            **(ledger.claim_state() if claimed else {}),
        )  # fmt: skip
        entry = self._routes.load(session_key) if turn_token else None
        cleared, rewrite = None, False
        if entry is not None and entry.active_turn_token == turn_token:
            cleared, rewrite = _ended(entry)
        marker = (cleared, turn_token) if cleared and turn_token else None
        stored = (session_id, reply) if reply is not None and session_id is not None else None
        try:
            # a turn's reply is written only under its lane's lease
            fenced: AbstractContextManager[dict[str, str]] = (
                self._leases.fenced(session_key) if turn_token else UNFENCED
            )
            with self._backing.canonical, fenced as fence:  # one backend write, one transaction
                _added, marker_cleared = ledger.rows.add_obligation(
                    record, marker, stored, **fence, rewrite=rewrite
                )
        except LeaseLostError:
            raise
        except StoreError as exc:
            logger.error("delivery ledger: could not record a reply: %s", exc)
            return None
        if cleared is not None and marker_cleared:
            self._routes.changed()
            self._routes.remember(cleared, self._routes.bumped(session_key))
            self._routes.notify(
                "turn_ended", cleared, token=turn_token, recorded=record.obligation_id
            )
        return record

    # -- after a restart ----------------------------------------------------------------------

    def _entries_with_markers(self, lanes: Collection[str] | None = None) -> list[SessionEntry]:
        with self._backing.canonical:
            stored = self._backing.backend.routes_with_markers()
        entries = [entry for entry in map(self._routes.parse, stored) if entry is not None]
        if lanes is not None:
            return [entry for entry in entries if entry.session_key in lanes]
        return [entry for entry in entries if self._leases.holds(entry.session_key)]

    def entries_with_fresh_markers(
        self, max_age_seconds: float, lanes: Collection[str] | None = None
    ) -> list[SessionEntry]:
        """Lanes whose turn marker has a start no older than ``max_age_seconds`` (any age
        when not positive): the turns a dead process left unfinished."""
        now = utc_now()
        return [
            entry
            for entry in self._entries_with_markers(lanes)
            if not self._stale(entry, now, max_age_seconds)
        ]

    @staticmethod
    def _stale(entry: SessionEntry, now: datetime, max_age_seconds: float) -> bool:
        started = entry.active_turn_started_at
        if started is None:
            return True
        return max_age_seconds > 0 and (now - started).total_seconds() > max_age_seconds

    @serialised
    def discard_active_turn_markers(self) -> int:
        """Clear every turn marker of this instance's lanes without arming a resume (after its
        clean stop); the count. On a shared store a lane that start-up found without a lease is
        left alone (:meth:`found_unleased`: its marker may be another process's)."""
        foreign = self._leases.found_unleased()
        entries = [e for e in self._entries_with_markers() if e.session_key not in foreign]
        self._routes.write_all([changed(entry, _CLEARED_MARKER) for entry in entries])
        return len(entries)

    @serialised
    def recover_turn_markers(
        self, max_age_seconds: float = 3600, lanes: Collection[str] | None = None
    ) -> MarkerRecovery:
        """Crash recovery of turn markers: a fresh marker on a non-suspended lane arms
        ``resume_pending`` (``restart_interrupted``) unless a more specific reason is already
        set; every marker is cleared; all in one transaction. A marker is stale when its start
        is missing or older than ``max_age_seconds`` (when positive); ages are epoch
        differences, immune to the host's time zone."""
        now = utc_now()
        armed: list[str] = []
        kept: list[str] = []
        updated: list[SessionEntry] = []
        for entry in self._entries_with_markers(lanes):
            changes: dict[str, object] = dict(_CLEARED_MARKER)
            if not self._stale(entry, now, max_age_seconds) and not entry.suspended:
                if entry.resume_pending:
                    kept.append(entry.session_key)
                    if entry.last_resume_marked_at is None:
                        changes["last_resume_marked_at"] = now
                else:
                    armed.append(entry.session_key)
                    changes.update(resume_pending=True, resume_reason="restart_interrupted",
                                   last_resume_marked_at=now)  # fmt: skip
            updated.append(changed(entry, changes))
        self._routes.write_all(updated)
        return MarkerRecovery(tuple(armed), tuple(kept), len(updated))
