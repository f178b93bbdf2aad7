"""Turn markers after a restart, the delivery obligations of finished turns and the durable
queue of events waiting for a turn.

A marker set by ``mark_turn_active`` is the only evidence that a turn was interrupted; these
operations turn the markers left by a dead process into ``resume_pending`` lanes (or discard them
after a clean stop) and record replies in the ledger, clearing the marker in the same commit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from hermes_core.domain.errors import (
    LeaseLostError,
    MessageRedeliveredError,
    StoreError,
)
from hermes_core.domain.models import MessageEvent, SessionEntry
from hermes_core.domain.text import clean_text
from hermes_core.domain.timeutil import utc_now
from hermes_core.state.instance import RestartCounter, RestartCounts, instance_id
from hermes_core.store.backend import (
    DeadLetter,
    Message,
    Obligation,
    RestartCountRows,
    new_obligation,
)
from hermes_core.store.base import MAINTENANCE_BATCH, changed, exclusive, serialised
from hermes_core.store.leases import UNFENCED, LeaseStore, QueuedEvent
from hermes_core.turns.ledger import DeliveryLedger, obligation_id

logger = logging.getLogger(__name__)

AUTO_RESUME_REASONS = frozenset({"restart_timeout", "shutdown_timeout", "restart_interrupted"})
_CLEARED_MARKER = {"active_turn_token": None, "active_turn_started_at": None}


class StoredRestartCounts:
    """Stuck-loop counts kept in the store, tagged with this instance (the in-memory copy is
    locked: writer threads of different lanes clear their counts at once)."""

    def __init__(self, rows: RestartCountRows, owner: str) -> None:
        self.rows = rows
        self.owner = owner
        self._counts: dict[str, int] | None = None
        self._lock = threading.RLock()

    def load(self) -> dict[str, int]:
        """The counts of the lanes this instance struck last (read once, then kept)."""
        with self._lock:
            if self._counts is None:
                self._counts = self.rows.restart_counts(self.owner)
            return dict(self._counts)

    def save(self, counts: Mapping[str, int]) -> None:
        """Replace this instance's counts."""
        with self._lock:
            self.rows.save_restart_counts(self.owner, counts)
            self._counts = dict(counts)

    def remove(self, session_key: str) -> None:
        """Forget a lane's count; no write when it has none."""
        with self._lock:
            if session_key not in self.load():
                return
            self.rows.remove_restart_count(session_key)
            if self._counts is not None:
                self._counts.pop(session_key, None)


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


class TurnRecoveryStore(LeaseStore):
    """Marker recovery and ledger recording on top of the store's plumbing and leases.

    On a shared store recovery touches only lanes whose lease this process holds (start-up
    takes the leases of lanes no live process holds first), or the ``lanes`` given."""

    _ledger: DeliveryLedger | None = None
    _counts: RestartCounter | None = None

    def _entries_with_markers(self, lanes: Collection[str] | None = None) -> list[SessionEntry]:
        with self._canonical():
            stored = self._backend.routes_with_markers()
        entries = [entry for entry in map(self._parse, stored) if entry is not None]
        if lanes is not None:
            return [entry for entry in entries if entry.session_key in lanes]
        return [entry for entry in entries if self.holds(entry.session_key)]

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

    def _write_all(self, entries: list[SessionEntry]) -> None:
        """Persist several entries in one transaction, then cache them."""
        if not entries:
            return
        with self._canonical():
            self._backend.put_routes([entry.to_dict() for entry in entries])
        self._routing_changed()
        for entry in entries:
            self._remember(entry)

    @serialised
    def discard_active_turn_markers(self) -> int:
        """Clear every turn marker of this instance's lanes without arming a resume (after its
        clean stop); the count. On a shared store a lane that start-up found without a lease is
        left alone (:meth:`found_unleased`: its marker may be another process's)."""
        foreign = self.found_unleased()
        entries = [e for e in self._entries_with_markers() if e.session_key not in foreign]
        self._write_all([changed(entry, _CLEARED_MARKER) for entry in entries])
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
        self._write_all(updated)
        return MarkerRecovery(tuple(armed), tuple(kept), len(updated))

    def recover_interrupted_turns(self, max_age_seconds: float = 3600) -> int:
        """Recover turn markers (:meth:`recover_turn_markers`); the number of lanes newly armed."""
        return len(self.recover_turn_markers(max_age_seconds).armed)

    def restart_counts(self) -> RestartCounter:
        """Where this store keeps stuck-loop counts: in the store, tagged with the instance, when
        the backend offers ``restart_counts`` (instances may share it), else
        ``$HERMES_HOME/restart_counts.json``."""
        rows = self._bound.counts
        if rows is not None:
            owner = instance_id(self.config.hermes_home, self.config.gateway.instance_id)
            return StoredRestartCounts(rows, owner)
        return RestartCounts(self.config.hermes_home)

    @property
    def counts(self) -> RestartCounter:
        """This store's stuck-loop counts (loaded once, see :meth:`restart_counts`)."""
        if self._counts is None:
            self._counts = self.restart_counts()
        return self._counts

    # -- delivery ledger ---------------------------------------------------------------------------

    @property
    def ledger(self) -> DeliveryLedger | None:
        """The delivery ledger, or None when disabled or unavailable (a backend without the
        ``ledger`` capability, degraded mode included)."""
        settings = self.config.gateway.delivery_ledger
        rows = self._bound.ledger
        if rows is None or not settings.enabled:
            return None
        if self._ledger is None or self._ledger.rows is not rows:
            notify = self.plugins.notify if self.plugins.observing else None
            self._ledger = DeliveryLedger(rows, settings, notify)
        return self._ledger

    def ledger_housekeeping(self) -> int | None:
        """The ledger's housekeeping (None without a ledger): stale rows abandoned, then the
        rows past retention or the row cap deleted in batches of :data:`MAINTENANCE_BATCH`,
        each a writer step of its own, so that turns' steps run between them; the count."""
        ledger = self.ledger
        return None if ledger is None else ledger.housekeeping(self._prune_obligations)

    def _prune_obligations(self, obligation_ids: list[str]) -> int:
        return sum(
            self._prune_obligation_batch(obligation_ids[start : start + MAINTENANCE_BATCH])
            for start in range(0, len(obligation_ids), MAINTENANCE_BATCH)
        )

    @exclusive
    def _prune_obligation_batch(self, obligation_ids: list[str]) -> int:
        rows = self._bound.ledger
        if rows is None:
            return 0
        with self._canonical():
            return rows.delete_terminal_obligations(obligation_ids)

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
    ) -> Obligation | None:
        """Record a reply before its first send; with ``turn_token`` the lane's
        marker is cleared in the same commit; ``claimed`` records it already ``attempting``
        (the send follows at once, so the claim needs no commit of its own); ``reply``, the
        reply's transcript message, is stored in the same commit too. Returns the row, or None
        when the ledger is off or failed (logged: a ledger failure never blocks a send; the
        caller then stores ``reply`` itself). ``content`` is stored (and to be sent) as
        :func:`~hermes_core.domain.text.clean_text` has it."""
        ledger = self.ledger
        if ledger is None:
            return None
        content = clean_text(content)  # what is sent is what is stored
        record = new_obligation(
            session_key, session_id, platform, chat_id, thread_id, reply_to_message_id, content,
            obligation_id=obligation_id(session_key, message_ref, content),
            origin_kind=origin_kind, **(ledger.claim_state() if claimed else {}),
        )  # fmt: skip
        entry = self._load(session_key) if turn_token else None
        cleared = None
        if entry is not None and entry.active_turn_token == turn_token:
            cleared = changed(entry, _CLEARED_MARKER)
        marker = (cleared, turn_token) if cleared and turn_token else None
        stored = (session_id, reply) if reply is not None and session_id is not None else None
        try:
            # a turn's reply is written only under its lane's lease
            fenced: AbstractContextManager[dict[str, str]] = (
                self._fenced(session_key) if turn_token else UNFENCED
            )
            with self._canonical(), fenced as fence:  # one backend write, one transaction
                _added, marker_cleared = ledger.rows.add_obligation(record, marker, stored, **fence)
        except LeaseLostError:
            raise
        except StoreError as exc:
            logger.error("delivery ledger: could not record a reply: %s", exc)
            return None
        if cleared is not None and marker_cleared:
            self._routing_changed()
            self._remember(cleared, self._bumped(session_key))
            self._notify("turn_ended", cleared, token=turn_token, recorded=record.obligation_id)
        return record

    # -- durable queue ----------------------------------------------------------

    @serialised
    def queue_add(self, session_key: str, event: MessageEvent) -> int | None:
        """Persist a queued event (and, for a human one, its platform message id as seen, in
        the same commit); its id, or None without the ``queue`` capability (queues are then
        memory-only). Raises :class:`MessageRedeliveredError` (nothing written) for a message
        seen before."""
        queue = self._bound.queue
        if queue is None:
            return None
        payload = json.dumps(event.to_dict(), ensure_ascii=False)
        with self._canonical():
            event_id = queue.add_queued(
                session_key, event.internal, event.bound_session_id, payload, _seen_id(event)
            )
        if event_id is None:
            raise MessageRedeliveredError("the platform delivered this message again")
        return event_id

    @serialised
    def queue_fail(self, event_id: int | None, error: str) -> bool:
        """Count a failed start of a queued event's turn; True when it has now used its
        ``gateway.max_dispatch_attempts`` and is set aside as a dead letter."""
        queue = self._bound.queue
        if queue is None or event_id is None:
            return False
        with self._canonical():
            return queue.fail_queued(event_id, error, self.config.gateway.max_dispatch_attempts)

    def dead_letters(self) -> list[DeadLetter]:
        """Queued events set aside after failing to start, oldest first (``[]`` without the
        ``queue`` capability)."""
        queue = self._bound.queue
        if queue is None:
            return []
        with self._canonical():
            return queue.dead_letters()

    def prune_seen_messages(self) -> int:
        """Forget platform message ids seen longer ago than ``gateway.redelivery_window_days``
        (housekeeping); the count. In batches of :data:`MAINTENANCE_BATCH` rows, each a writer
        step of its own, so that turns' steps run between them."""
        before = time.time() - self.config.gateway.redelivery_window_days * 86_400
        total = 0
        while (pruned := self._prune_seen_batch(before)) == MAINTENANCE_BATCH:
            total += pruned
        return total + pruned

    @serialised
    def _prune_seen_batch(self, before: float) -> int:
        queue = self._bound.queue
        if queue is None:
            return 0
        with self._canonical():
            return queue.prune_seen(before, MAINTENANCE_BATCH)

    @serialised
    def queue_remove(self, event_ids: list[int]) -> int:
        """Delete discarded queued events."""
        queue = self._bound.queue
        if queue is None or not event_ids:
            return 0
        with self._canonical():
            return queue.remove_queued(event_ids)

    def queue_restore(self, session_key: str | None = None) -> list[QueuedEvent]:
        """Every persisted queued event (id, key, event), oldest first (on a shared store
        open for writing, of the lanes this process holds), or those of ``session_key``;
        unreadable ones are skipped with a warning and left in place."""
        queue = self._bound.queue
        if queue is None:
            return []
        with self._canonical():
            if session_key is not None and not self.read_only:
                stored = queue.queued(session_key)  # the writer's connection: sees its batch
            elif session_key is not None:
                stored = [row for row in queue.queued() if row[1] == session_key]
            else:
                stored = [row for row in queue.queued() if self.read_only or self.holds(row[1])]
        return self._queued_events(stored)


def _seen_id(event: MessageEvent) -> str | None:
    """The platform message id a human event is remembered by (None: nothing to remember)."""
    return str(event.message_id) if event.message_id and not event.internal else None
