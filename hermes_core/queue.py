"""TurnQueue: the per-lane queue of inbound events waiting for a turn (SPEC §8.2-§8.7).

Per session key one ordered list: the head is the *slot* (next up), the rest the *overflow*. Every
enqueue, merge and discard is written to the store's ``queued_events`` (tier D) before it shows in
memory; while the store is degraded ``queue_add`` returns no id and items live in memory only.
Dequeue for a turn belongs to the runtime: it takes the head with :meth:`TurnQueue.pop_head` and
passes its ``event_id`` to ``store.mark_turn_active``, which deletes the row with the turn marker.

Concurrency: every mutating call runs on the store's writer thread (inline when already there, as
in a runtime step that enqueues or dispatches), so mutations never interleave and the order in
memory is the order of the durable ids. A lock guards the lists only briefly, so ``depth``,
``head``, ``items`` and ``lanes`` never wait for I/O. The mutating calls block until their commit
(an asyncio host runs them inside ``store.arun``). Logs never name session keys.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cachetools import LRUCache

from hermes_core.config import GatewayConfig
from hermes_core.errors import MessageRedeliveredError, StoreError
from hermes_core.models import MessageEvent, MessageType
from hermes_core.specs import LifecycleEvent, LifecycleKind
from hermes_core.store import SessionStore

__all__ = ["MERGED_KEY", "EnqueueResult", "QueuedItem", "SeenMessages", "TurnQueue"]

logger = logging.getLogger(__name__)

MERGED_KEY = "merged_messages"
"""Metadata key of a merged event: how many human messages it holds (survives a restart)."""


@dataclass
class QueuedItem:
    """One queued event: a message, a merged burst or album, a ``/queue`` item or a wake."""

    event: MessageEvent
    event_id: int | None
    """The ``queued_events`` row (None: held in memory only, while the store is degraded)."""
    humans: int
    """Human messages merged into this item (1 for a plain human item, 0 for an internal one)."""
    last_arrival: float
    """``clock()`` of the last arrival merged into it."""
    restored: bool = False
    """Restored after a restart: never merges with events that arrive after it."""
    order: int = field(default=0, compare=False)
    """Queue-wide arrival number, set by the queue (orders :meth:`TurnQueue.lanes`)."""
    attempts: int = 0
    """Failed starts of its turn so far (see ``gateway.max_dispatch_attempts``)."""


@dataclass(frozen=True)
class EnqueueResult:
    """What :meth:`TurnQueue.enqueue` did; ``depth`` is the lane's depth after the call.

    ``refused``: ``cap`` (the lane is full), ``not_saved`` (the commit failed) or ``duplicate``
    (the platform delivered a message the lane already has: nothing to do)."""

    accepted: bool
    merged: bool
    depth: int
    refused: Literal["cap", "not_saved", "duplicate"] | None = None


def _restore(item: QueuedItem, event: MessageEvent, last_arrival: float, humans: int) -> None:
    """Undo a merge into ``item`` (its commit was rolled back)."""
    item.event, item.last_arrival, item.humans = event, last_arrival, humans


def _mergeable(event: MessageEvent) -> bool:
    """Human and not a ``/queue`` item."""
    return not event.internal and not event.queued_via_command


def _participant(event: MessageEvent) -> str | None:
    return event.source.user_id_alt or event.source.user_id or None


def _humans(event: MessageEvent) -> int:
    """Human messages in a restored event: 0 for a wake, else its recorded merge count (1)."""
    if event.internal:
        return 0
    count = event.metadata.get(MERGED_KEY)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 1 else 1


class TurnQueue:
    """Slot plus FIFO overflow per session key, persisted through the :class:`SessionStore`."""

    def __init__(
        self,
        store: SessionStore,
        config: GatewayConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        notify: Callable[[LifecycleEvent], None] | None = None,
    ) -> None:
        self._store = store
        self._settings = config.gateway.busy_queue
        self._clock = clock
        self._notify = notify
        self._lock = threading.Lock()
        self._lanes: dict[str, list[QueuedItem]] = {}
        self._order = itertools.count(1)

    def _items(self, session_key: str) -> list[QueuedItem]:
        """The lane's list (writer thread only; an empty one is dropped by :meth:`_tidy`)."""
        with self._lock:
            return self._lanes.setdefault(session_key, [])

    def _tidy(self, session_key: str) -> None:
        with self._lock:
            if not self._lanes.get(session_key, True):
                del self._lanes[session_key]

    def _emit(self, kind: LifecycleKind, session_key: str, **detail: object) -> None:
        """Tell observers, once the change is committed."""
        notify = self._notify
        if notify is None:
            return

        def send() -> None:
            try:
                notify(LifecycleEvent(kind=kind, session_key=session_key, detail=detail))
            except Exception:
                logger.exception("observer of %s failed", kind)

        self._store.after_commit(send)

    def _merge(self, tail: QueuedItem, event: MessageEvent, now: float) -> MessageEvent | None:
        """``tail``'s event with ``event`` merged in (SPEC §8.3), or None if they must not merge."""
        first = tail.event
        window = self._settings.burst_window_secs
        if not (window > 0 and now - tail.last_arrival <= window and not tail.restored):
            return None
        if not (_mergeable(first) and _mergeable(event)):
            return None
        who = _participant(event)
        if who is None or who != _participant(first):
            return None
        text, photo = MessageType.TEXT, MessageType.PHOTO
        if event.message_type is photo and first.message_type in (text, photo):
            kind = photo
        elif first.message_type is event.message_type is text and not (
            first.media_urls or event.media_urls
        ):
            kind = text
        else:
            return None
        return first.replace(
            text="\n".join(part for part in (first.text, event.text) if part),
            message_type=kind,
            media_urls=first.media_urls + event.media_urls,
            metadata={**first.metadata, MERGED_KEY: tail.humans + 1},
        )

    def enqueue(self, session_key: str, event: MessageEvent) -> EnqueueResult:
        """Merge ``event`` into the lane's tail or append it, committed before it is accepted.

        Refused with ``"cap"`` at ``max_pending`` (a merge is still allowed), ``"not_saved"``
        when the commit fails and ``"duplicate"`` for a platform message the lane already has;
        a refused event is neither stored nor kept.
        """
        return self._store.run(self._enqueue, session_key, event)

    def _enqueue(self, session_key: str, event: MessageEvent) -> EnqueueResult:
        items = self._items(session_key)
        now = self._clock()
        tail = items[-1] if items else None
        merged = self._merge(tail, event, now) if tail is not None else None
        refused: Literal["cap", "not_saved", "duplicate"] | None = None
        if merged is None and len(items) >= self._settings.max_pending:
            refused = "cap"
        else:
            try:
                if tail is not None and merged is not None:
                    self._store.queue_replace(tail.event_id, merged, session_key, event)
                else:
                    event_id = self._store.queue_add(session_key, event)
            except MessageRedeliveredError:
                refused = "duplicate"
            except StoreError as exc:
                logger.error("a queued event could not be saved: %s", exc)
                refused = "not_saved"
            else:
                with self._lock:
                    if tail is not None and merged is not None:
                        self._store.on_rollback(
                            functools.partial(_restore, tail, tail.event, tail.last_arrival,
                                              tail.humans)
                        )  # fmt: skip
                        tail.event, tail.last_arrival = merged, now
                        tail.humans += 1
                    else:
                        humans = 0 if event.internal else 1
                        item = QueuedItem(event, event_id, humans, now, order=next(self._order))
                        items.append(item)
                        self._store.on_rollback(functools.partial(self._unqueue, session_key, item))
        depth = len(items)
        self._tidy(session_key)
        if refused == "duplicate":
            return EnqueueResult(False, False, depth, refused)
        if refused is not None:
            if event.internal:
                logger.warning("an internal event was refused (%s, depth %d)", refused, depth)
            self._emit("queue_refused", session_key, reason=refused, depth=depth)
            return EnqueueResult(False, False, depth, refused)
        if merged is not None:
            self._emit(
                "queue_merged", session_key, depth=depth, messages=merged.metadata[MERGED_KEY]
            )
        else:
            self._emit("queue_accepted", session_key, depth=depth, internal=event.internal)
        return EnqueueResult(True, merged is not None, depth)

    def depth(self, session_key: str) -> int:
        """Items queued on the lane (slot included)."""
        with self._lock:
            return len(self._lanes.get(session_key, ()))

    def head(self, session_key: str) -> QueuedItem | None:
        """The slot item (next up), left in place."""
        with self._lock:
            items = self._lanes.get(session_key)
            return items[0] if items else None

    def items(self, session_key: str) -> list[QueuedItem]:
        """A snapshot of the lane's items, slot first."""
        with self._lock:
            return list(self._lanes.get(session_key, ()))

    def pop_head(self, session_key: str) -> QueuedItem | None:
        """Take the slot item out of memory; the runtime deletes its row with the turn marker."""
        return self._store.run(self._pop_head, session_key)

    def _pop_head(self, session_key: str) -> QueuedItem | None:
        with self._lock:
            items = self._lanes.get(session_key)
            if not items:
                return None
            item = items.pop(0)
            if not items:
                del self._lanes[session_key]
        self._store.on_rollback(functools.partial(self._push_front, session_key, item))
        return item

    def _unqueue(self, session_key: str, item: QueuedItem) -> None:
        """Take an item out again (its enqueue was rolled back)."""
        with self._lock:
            items = self._lanes.get(session_key, [])
            if item in items:
                items.remove(item)
            if not items:
                self._lanes.pop(session_key, None)

    def push_front(self, session_key: str, item: QueuedItem) -> None:
        """Put back a head that could not be dispatched (its row was never deleted)."""
        self._store.run(self._push_front, session_key, item)

    def _push_front(self, session_key: str, item: QueuedItem) -> None:
        with self._lock:
            self._lanes.setdefault(session_key, []).insert(0, item)

    def _discard(self, session_key: str, slot_only: bool) -> int:
        return self._store.run(self._discard_now, session_key, slot_only)

    def _discard_now(self, session_key: str, slot_only: bool) -> int:
        with self._lock:
            items = list(self._lanes.get(session_key, ()))
        if slot_only:
            victims = items[:1] if items and _mergeable(items[0].event) else []
        else:
            victims = [item for item in items if not item.event.internal]
        if not victims:
            return 0
        self._store.queue_remove([i.event_id for i in victims if i.event_id is not None])
        self._store.on_rollback(functools.partial(self._put_back, session_key, items))
        with self._lock:
            gone = {id(item) for item in victims}
            kept = [item for item in self._lanes.get(session_key, ()) if id(item) not in gone]
            depth = len(kept)
            if kept:
                self._lanes[session_key] = kept
            else:
                self._lanes.pop(session_key, None)
        messages = sum(item.humans for item in victims)
        scope = "slot" if slot_only else "humans"
        self._emit("queue_discarded", session_key, scope=scope, items=len(victims),
                   messages=messages, depth=depth)  # fmt: skip
        return messages

    def _put_back(self, session_key: str, items: list[QueuedItem]) -> None:
        """Restore a lane's items as they were (a discard was rolled back)."""
        with self._lock:
            self._lanes[session_key] = list(items)

    def discard_slot(self, session_key: str) -> int:
        """``/stop``: drop the slot if it holds a human non-``/queue`` item; the human messages
        it held. Overflow items all stay, in order. Raises ``StoreError`` (nothing discarded)
        when the removal cannot be committed."""
        return self._discard(session_key, slot_only=True)

    def discard_humans(self, session_key: str) -> int:
        """``/new``, ``/reset``: drop every human item (``/queue`` ones too), keep internal wakes
        in order; the human messages dropped. Raises ``StoreError`` like :meth:`discard_slot`."""
        return self._discard(session_key, slot_only=False)

    def restore(self) -> int:
        """Load the persisted queues (start-up, before any enqueue); the number of items."""
        if self.lanes():
            raise RuntimeError("TurnQueue.restore() must run before anything is queued")
        restored = self._store.queue_restore()
        now = self._clock()
        with self._lock:
            for event_id, session_key, event in restored:
                item = QueuedItem(event, event_id, _humans(event), now, True, next(self._order))
                self._lanes.setdefault(session_key, []).append(item)
        return len(restored)

    def lanes(self) -> list[str]:
        """Keys with queued items, ordered by the arrival of their oldest item."""
        with self._lock:
            heads = [(items[0].order, key) for key, items in self._lanes.items() if items]
        return [key for _, key in sorted(heads)]


class SeenMessages:
    """Platform messages recently seen per lane, so a redelivery (e.g. of a message whose
    acknowledgement a crash prevented) is not answered twice. Bounded (least recent forgotten)."""

    def __init__(self, size: int = 10_000) -> None:
        self._seen: LRUCache[tuple[str, str], bool] = LRUCache(maxsize=size)

    def seen_before(self, session_key: str, event: MessageEvent) -> bool:
        """Whether the event's platform message was already seen on the lane."""
        return bool(event.message_id) and (session_key, str(event.message_id)) in self._seen

    def remember(self, session_key: str, message_id: object) -> None:
        """Note a platform message id as seen on the lane (empty ids are ignored)."""
        if message_id:
            self._seen[(session_key, str(message_id))] = True

    def remember_event(self, session_key: str, event: MessageEvent) -> None:
        """Note a human event's platform message."""
        if not event.internal:
            self.remember(session_key, event.message_id)
