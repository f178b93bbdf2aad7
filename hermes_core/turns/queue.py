"""TurnQueue: the per-lane queue of inbound events waiting for a turn.

Per session key one ordered list: the head is the *slot* (next up), the rest the *overflow*. Every
enqueue, merge and discard is written to the store's ``queued_events`` (tier D) before it shows in
memory; while the store is degraded ``queue_add`` returns no id and items live in memory only.
Dequeue for a turn belongs to the runtime: it takes the head with :meth:`TurnQueue.pop_head` and
passes its ``event_id`` to ``store.mark_turn_active``, which deletes the row with the turn marker;
the item's follow-up rows (:attr:`QueuedItem.part_ids`) go in the same transaction.

A merged burst is stored as rows, not rewritten: the first message keeps its row and each
follow-up is a row of its own whose metadata names the first one's id (:data:`PART_OF_KEY`), so a
merge writes only the new message and :meth:`TurnQueue.restore` folds the rows back together. A
burst stops growing at ``gateway.busy_queue.burst_max_parts`` messages or ``burst_max_bytes`` of
text and media URLs; the next follow-up then starts a new item.

Concurrency: every mutating call runs on the store's writer thread (inline when already there, as
in a runtime step that enqueues or dispatches), so mutations never interleave and the order in
memory is the order of the durable ids. A lock guards the lists only briefly, so ``depth``,
``head``, ``items`` and ``lanes`` never wait for I/O. The mutating calls block until their commit
(an asyncio host runs them inside ``store.arun``). Logs never name session keys.

One module on purpose: the slot, the overflow, merges, restore and dead letters all follow the
row layout above.
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

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import MessageRedeliveredError, StoreError
from hermes_core.domain.models import MessageEvent, MessageType
from hermes_core.domain.recent import Recent
from hermes_core.domain.specs import LifecycleEvent, LifecycleKind
from hermes_core.store import SessionStore
from hermes_core.store.queue_rows import QueuedEvent

__all__ = [
    "MERGED_KEY", "PART_OF_KEY", "EnqueueResult", "QueuedItem", "SeenMessages", "TurnQueue",
]  # fmt: skip

logger = logging.getLogger(__name__)

MERGED_KEY = "merged_messages"
"""Metadata key of a merged event: how many human messages it holds (survives a restart)."""


PART_OF_KEY = "merged_into"
"""Metadata key of a stored follow-up row: the ``queued_events`` id of the item it belongs to."""


def _size(event: MessageEvent) -> int:
    """What a message adds to a burst's byte count: its text and media URLs in UTF-8."""
    return len(event.text.encode()) + sum(len(url.encode()) for url in event.media_urls)


@dataclass(eq=False)
class QueuedItem:
    """One queued event: a message, a merged burst or album, a ``/queue`` item or a wake.

    A burst keeps its messages apart (``first`` and ``follow_ups``); :attr:`event` joins them
    on first use, so a merge costs only the new message."""

    first: MessageEvent
    """The item's first message (its identity: event id, platform message id, metadata)."""
    event_id: int | None
    """The ``queued_events`` row (None: held in memory only, while the store is degraded)."""
    humans: int
    """Human messages merged into this item (1 for a plain human item, 0 for an internal one)."""
    last_arrival: float
    """``clock()`` of the last arrival merged into it."""
    restored: bool = False
    """Restored after a restart: never merges with events that arrive after it."""
    sealed: bool = False
    """A command arrived after it (see :meth:`TurnQueue.cut`): it takes no more follow-ups."""
    order: float = field(default=0, compare=False)
    """Queue-wide arrival number, set by the queue (orders :meth:`TurnQueue.lanes`); it grows
    along a lane's list (see :meth:`TurnQueue.reload`)."""
    attempts: int = 0
    """Failed starts of its turn so far (see ``gateway.max_dispatch_attempts``)."""
    follow_ups: list[tuple[int | None, MessageEvent]] = field(default_factory=list)
    """Messages merged in after ``first``, with their rows, in arrival order."""
    size: int = field(init=False)
    """Bytes of text and media URLs so far (see ``gateway.busy_queue.burst_max_bytes``)."""
    _version: int = field(init=False, default=0, repr=False)
    """Changes so far: a joined event cached at an older version is stale."""
    _joined: tuple[int, MessageEvent] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.size = _size(self.first)

    @property
    def event(self) -> MessageEvent:
        """The event a turn runs: ``first`` with the follow-ups' texts joined by ``\\n`` and
        their media appended; PHOTO if any is a photo; ``MERGED_KEY`` holds the count.

        Safe to read from another thread while the writer merges: the version is read before
        the parts, and :meth:`add` bumps it after changing them, so a join that raced a merge
        is cached under an older version and built again on the next read."""
        version, joined = self._version, self._joined
        if joined is not None and joined[0] == version:
            return joined[1]
        if not self.follow_ups:
            return self.first
        parts = [self.first, *(event for _, event in self.follow_ups)]
        event = self.first.replace(
            text="\n".join(part.text for part in parts if part.text),
            message_type=parts[-1].message_type,
            media_urls=tuple(url for part in parts for url in part.media_urls),
            metadata={**self.first.metadata, MERGED_KEY: self.humans},
        )
        self._joined = (version, event)
        return event

    @property
    def kind(self) -> MessageType:
        """The merged type: a photo turns a burst into an album, and only photos follow one."""
        return (self.follow_ups[-1][1] if self.follow_ups else self.first).message_type

    @property
    def part_ids(self) -> list[int]:
        """The follow-ups' rows (deleted with the first one's when the item leaves the queue)."""
        return [event_id for event_id, _ in self.follow_ups if event_id is not None]

    @property
    def row_ids(self) -> list[int]:
        """Every row of the item."""
        return ([] if self.event_id is None else [self.event_id]) + self.part_ids

    def add(self, event_id: int | None, event: MessageEvent, now: float) -> None:
        """Merge a follow-up in (its row already written)."""
        self.follow_ups.append((event_id, event))
        self.humans += 1
        self.size += _size(event)
        self.last_arrival = now
        self._version += 1

    def rewrite(self, event: MessageEvent) -> None:
        """Run ``event`` instead of the item's command (a ``/queue`` or a reset with text after
        it), in the item's place; its row keeps the command, so a restart reads it again (a
        :meth:`TurnQueue.reload` keeps the rewrite)."""
        self.first = event
        self.size = _size(event)
        self._version += 1

    def take_back(self, last_arrival: float) -> None:
        """Undo the last :meth:`add` (its commit was rolled back)."""
        _, event = self.follow_ups.pop()
        self.humans -= 1
        self.size -= _size(event)
        self.last_arrival = last_arrival
        self._version += 1


@dataclass(frozen=True)
class EnqueueResult:
    """What :meth:`TurnQueue.enqueue` did; ``depth`` is the lane's depth after the call.

    ``refused``: ``cap`` (the lane is full), ``full`` (all lanes together are), ``not_saved``
    (the commit failed) or ``duplicate`` (the platform delivered a message the lane already
    has: nothing to do)."""

    accepted: bool
    merged: bool
    depth: int
    refused: Literal["cap", "full", "not_saved", "duplicate"] | None = None


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
        is_command: Callable[[MessageEvent], bool] | None = None,
    ) -> None:
        self._store = store
        self._is_command = is_command
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

        self._store._writer.after_commit(send)

    def _mergeable_into(self, tail: QueuedItem, event: MessageEvent, now: float) -> bool:
        """Whether ``event`` merges into ``tail`` within the burst bounds.

        An item whose turn failed to start takes no more follow-ups: all its rows then share one
        attempt count and become a dead letter together."""
        first, settings = tail.first, self._settings
        window = settings.burst_window_secs
        if not (window > 0 and now - tail.last_arrival <= window):
            return False
        if tail.restored or tail.sealed or self._command_in(tail.first, event):
            return False
        if tail.attempts or not (_mergeable(first) and _mergeable(event)):
            return False
        if len(tail.follow_ups) + 1 >= settings.burst_max_parts:
            return False
        if tail.size + _size(event) > settings.burst_max_bytes:
            return False
        who = _participant(event)
        if who is None or who != _participant(first):
            return False
        text, photo = MessageType.TEXT, MessageType.PHOTO
        if event.message_type is photo:
            return tail.kind in (text, photo)
        no_media = not (first.media_urls or event.media_urls)
        return tail.kind is event.message_type is text and no_media

    def _command_in(self, *events: MessageEvent) -> bool:
        """Whether one of ``events`` is a lane command: a command is an item of its own."""
        is_command = self._is_command
        return is_command is not None and any(is_command(event) for event in events)

    def enqueue(self, session_key: str, event: MessageEvent) -> EnqueueResult:
        """Merge ``event`` into the lane's tail or append it, committed before it is accepted.

        Refused with ``"cap"`` at ``max_pending`` items on the lane and ``"full"`` at
        ``max_total`` items on all lanes together (a merge is still allowed: the items are held
        in memory too, and this bounds them), ``"not_saved"`` when the commit fails and
        ``"duplicate"`` for a platform message the lane already has; a refused event is neither
        stored nor kept.
        """
        return self._store.run(self._enqueue, session_key, event, lane=session_key)

    def _write(self, session_key: str, event: MessageEvent, tail: QueuedItem | None) -> int | None:
        """Store a new item, or a follow-up of ``tail`` as a row of its own (nothing for a
        memory-only tail, so that no follow-up row outlives its item)."""
        if tail is None:
            return self._store._queue.add(session_key, event)
        if tail.event_id is None:
            return None
        part = event.replace(metadata={**event.metadata, PART_OF_KEY: tail.event_id})
        return self._store._queue.add(session_key, part)

    def _enqueue(self, session_key: str, event: MessageEvent) -> EnqueueResult:
        items = self._items(session_key)
        now = self._clock()
        tail = items[-1] if items and self._mergeable_into(items[-1], event, now) else None
        refused: Literal["cap", "full", "not_saved", "duplicate"] | None = None
        if tail is None and len(items) >= self._settings.max_pending:
            refused = "cap"
        elif tail is None and self.total() >= self._settings.max_total:
            refused = "full"
        else:
            try:
                event_id = self._write(session_key, event, tail)
            except MessageRedeliveredError:
                refused = "duplicate"
            except StoreError as exc:
                logger.error("a queued event could not be saved: %s", exc)
                refused = "not_saved"
            else:
                with self._lock:
                    if tail is not None:
                        undo = functools.partial(tail.take_back, tail.last_arrival)
                        tail.add(event_id, event, now)
                    else:
                        humans = 0 if event.internal else 1
                        item = QueuedItem(event, event_id, humans, now, order=next(self._order))
                        items.append(item)
                        undo = functools.partial(self._unqueue, session_key, item)
                self._store._writer.on_rollback(undo)
        depth = len(items)
        self._tidy(session_key)
        if refused == "duplicate":
            return EnqueueResult(False, False, depth, refused)
        if refused is not None:
            if event.internal:
                logger.warning("an internal event was refused (%s, depth %d)", refused, depth)
            self._emit("queue_refused", session_key, reason=refused, depth=depth)
            return EnqueueResult(False, False, depth, refused)
        if tail is not None:
            self._emit("queue_merged", session_key, depth=depth, messages=tail.humans)
        else:
            self._emit("queue_accepted", session_key, depth=depth, internal=event.internal)
        return EnqueueResult(True, tail is not None, depth)

    def total(self) -> int:
        """Items queued on all lanes together (held in memory; see ``max_total``)."""
        with self._lock:
            return sum(map(len, self._lanes.values()))

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
        return self._store.run(self._pop_head, session_key, lane=session_key)

    def _pop_head(self, session_key: str) -> QueuedItem | None:
        with self._lock:
            items = self._lanes.get(session_key)
            if not items:
                return None
            item = items.pop(0)
            if not items:
                del self._lanes[session_key]
        self._store._writer.on_rollback(functools.partial(self._push_front, session_key, item))
        return item

    def _unqueue(self, session_key: str, item: QueuedItem) -> None:
        """Take an item out again (its enqueue was rolled back)."""
        with self._lock:
            items = self._lanes.get(session_key, [])
            if item in items:
                items.remove(item)
            if not items:
                self._lanes.pop(session_key, None)

    def _push_front(self, session_key: str, item: QueuedItem) -> None:
        """Put a taken head back (its step was rolled back, so its row was never deleted)."""
        with self._lock:
            self._lanes.setdefault(session_key, []).insert(0, item)

    def cut(self, session_key: str) -> int:
        """A command arrives (writer thread): the lane's items so far come before it (their
        :attr:`QueuedItem.order` is below the number returned, later ones above), and its tail
        takes no more follow-ups, so a message sent after the command never joins them."""
        with self._lock:
            items = self._lanes.get(session_key)
            if items:
                items[-1].sealed = True
            return next(self._order)

    def _discard(self, session_key: str, slot_only: bool, before: float | None) -> int:
        return self._store.run(self._discard_now, session_key, slot_only, before,
                               lane=session_key)  # fmt: skip

    def _discard_now(self, session_key: str, slot_only: bool, before: float | None) -> int:
        with self._lock:
            items = list(self._lanes.get(session_key, ()))
        earlier = [item for item in items if before is None or item.order < before]
        if slot_only:  # the slot, if it came before the command
            victims = [item for item in earlier[:1] if item is items[0] and _mergeable(item.event)]
        else:
            victims = [item for item in earlier if not item.event.internal]
        if not victims:
            return 0
        self._store._queue.remove([row for item in victims for row in item.row_ids])
        self._store._writer.on_rollback(functools.partial(self._put_back, session_key, items))
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

    def discard_slot(self, session_key: str, before: float | None = None) -> int:
        """``/stop``: drop the slot if it holds a human non-``/queue`` item queued before the
        command (``before``, from :meth:`cut`; None: any); the human messages it held. Overflow
        items all stay, in order. Raises ``StoreError`` (nothing discarded) when the removal
        cannot be committed."""
        return self._discard(session_key, True, before)

    def discard_humans(self, session_key: str, before: float | None = None) -> int:
        """``/new``, ``/reset``: drop every human item (``/queue`` ones too) queued before the
        command (``before``, as for :meth:`discard_slot`), keep internal wakes and every later
        item in order; the human messages dropped. Raises ``StoreError`` like
        :meth:`discard_slot`."""
        return self._discard(session_key, False, before)

    def restore(self) -> int:
        """Load the persisted queues (start-up, before anything is queued), folding each
        follow-up row into its item; the number of items. A follow-up whose item is gone is
        kept as an item of its own (logged), so nothing stored is lost."""
        if self.lanes():
            raise RuntimeError("TurnQueue.restore() must run before anything is queued")
        return self._fold(self._store._queue.restore(), restored=True)

    def _fold(
        self, rows: list[QueuedEvent], *, restored: bool, known: dict[int, QueuedItem] | None = None
    ) -> int:
        """Append stored rows to their lanes, each follow-up folded into its item; an item
        whose row is in ``known`` keeps that item's order number (see :meth:`cut`), its failed
        starts (towards its dead-lettering), its rewrite and its seal; the others are numbered
        in their place (see :meth:`_number`)."""
        now = self._clock()
        count = 0
        fresh: set[int] = set()
        filled: dict[str, list[QueuedItem]] = {}
        with self._lock:
            for event_id, session_key, stored in rows:
                items = filled[session_key] = self._lanes.setdefault(session_key, [])
                part_of = stored.metadata.get(PART_OF_KEY)
                if part_of is not None and items and items[-1].event_id == part_of:
                    items[-1].add(event_id, stored, now)
                    continue
                event = stored
                if part_of is not None:
                    # Its item may stand before another process's event that came between them
                    # (a shared store): kept apart so the lane's order holds, as expected.
                    if not any(item.event_id == part_of for item in items):
                        logger.warning("queued follow-up %d lost its item; kept alone", event_id)
                    metadata = {k: v for k, v in stored.metadata.items() if k != PART_OF_KEY}
                    event = stored.replace(metadata=metadata)
                before = (known or {}).get(event_id)
                if before is None:
                    item = QueuedItem(event, event_id, _humans(event), now, restored)
                    fresh.add(id(item))
                else:
                    item = QueuedItem(before.first, event_id, _humans(event), now,
                                      restored or before.restored, before.sealed,
                                      order=before.order, attempts=before.attempts)  # fmt: skip
                items.append(item)
                count += 1
            for items in filled.values():
                self._number(items, fresh)
        return count

    def _number(self, items: list[QueuedItem], fresh: set[int]) -> None:
        """Number a lane's ``fresh`` items (by ``id()``) so that the numbers grow along its list:
        one after the last known item draws the next arrival number, one before a known item
        a number between its neighbours'. An event another process stored before this one's
        own then counts as before them, and a command's number (its :meth:`cut`) splits the
        lane where the command stands."""
        following: list[float | None] = []
        upper: float | None = None
        for item in reversed(items):
            following.append(upper)
            if id(item) not in fresh:
                upper = item.order
        previous: float | None = None
        for item, upper in zip(items, reversed(following), strict=True):
            if id(item) in fresh:
                if upper is None:
                    item.order = next(self._order)
                else:
                    lower = previous if previous is not None else upper - 1
                    item.order = (lower + upper) / 2
            previous = item.order

    def reload(self, session_key: str, rows: list[QueuedEvent] | None = None) -> int:
        """Replace the lane's items with its durable queue, read here or given as ``rows``
        (all of the lane's, as the store just read them) (writer thread; a shared store's lease
        holder does this on taking the lane, so events other processes queued run here, in
        order). The number of items."""
        if rows is None:
            rows = self._store._queue.restore(session_key)
        with self._lock:
            previous = self._lanes.pop(session_key, [])
        self._store._writer.on_rollback(lambda: self._put_lane(session_key, previous))
        known = {item.event_id: item for item in previous if item.event_id is not None}
        return self._fold(rows, restored=False, known=known)

    def take(self, session_key: str, item: QueuedItem) -> None:
        """Take ``item`` out of the lane's queue (memory and rows), wherever it stands: a
        command carried out from its place (writer thread)."""
        with self._lock:
            items = list(self._lanes.get(session_key, ()))
        self._store._queue.remove(item.row_ids)
        self._store._writer.on_rollback(functools.partial(self._put_back, session_key, items))
        self._unqueue(session_key, item)

    def forget(self, session_key: str) -> None:
        """Drop the lane's items from memory only (another process holds the lane and runs
        them; writer thread)."""
        with self._lock:
            previous = self._lanes.pop(session_key, [])
        self._store._writer.on_rollback(lambda: self._put_lane(session_key, previous))

    def _put_lane(self, session_key: str, items: list[QueuedItem]) -> None:
        with self._lock:
            if items:
                self._lanes[session_key] = items
            else:
                self._lanes.pop(session_key, None)

    def lanes(self) -> list[str]:
        """Keys with queued items, ordered by the arrival of their oldest item."""
        with self._lock:
            heads = [(items[0].order, key) for key, items in self._lanes.items() if items]
        return [key for _, key in sorted(heads)]


class SeenMessages:
    """Platform messages recently seen per lane, so a redelivery (e.g. of a message whose
    acknowledgement a crash prevented) is not answered twice. Bounded (least recent forgotten);
    locked, since several writer threads note messages of their lanes."""

    def __init__(self, size: int = 10_000) -> None:
        self._seen: Recent[tuple[str, str], None] = Recent(size)
        self._lock = threading.Lock()

    def seen_before(self, session_key: str, event: MessageEvent) -> bool:
        """Whether the event's platform message was already seen on the lane."""
        if not event.message_id:
            return False
        with self._lock:
            return (session_key, str(event.message_id)) in self._seen

    def remember(self, session_key: str, message_id: object) -> None:
        """Note a platform message id as seen on the lane (empty ids are ignored)."""
        if message_id:
            with self._lock:
                self._seen.put((session_key, str(message_id)), None)

    def remember_event(self, session_key: str, event: MessageEvent) -> None:
        """Note a human event's platform message."""
        if not event.internal:
            self.remember(session_key, event.message_id)
