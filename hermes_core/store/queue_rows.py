"""The rows of the durable queue: events waiting for a lane's turn, the dead letters set aside
after failing to start, and the platform message ids each lane has seen (the redelivery check).

Without the backend's ``queue`` capability queues are memory-only: adding stores nothing and
reading finds nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, MessageRedeliveredError, shown
from hermes_core.domain.models import MessageEvent
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import DeadLetter
from hermes_core.store.backing import Backing
from hermes_core.store.base import MAINTENANCE_BATCH, serialised
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

QueuedEvent = tuple[int, str, MessageEvent]
"""A durably queued event as the store reads it back: (id, session key, event)."""


def read_queued(
    stored: Iterable[tuple[int, str, str]],
    backing: Backing,
    plugins: HermesPluginManager,
    *,
    set_aside: bool = False,
) -> list[QueuedEvent]:
    """Queued events as stored (id, key, payload), parsed. An unreadable one is skipped with a
    warning and left in place, or with ``set_aside`` made a dead letter (the lease holder's
    release: left queued, it would keep the lane's lease held for ever)."""
    events = []
    for event_id, key, payload in stored:
        try:
            event = MessageEvent.from_dict(json.loads(payload), plugins=plugins)
        except (ValueError, InvalidValueError) as exc:
            queue = backing.bound.queue
            if not set_aside or queue is None:
                logger.warning(
                    "queued event %d of %s cannot be read: %s", event_id, shown(key),
                    shown(str(exc)),
                )  # fmt: skip
                continue
            logger.error(
                "queued event %d of %s cannot be read (%s); set aside as a dead letter "
                "(`hermes-sessions requeue %d` puts it back once the gateways can read it)",
                event_id, shown(key), shown(str(exc)), event_id,
            )  # fmt: skip
            with backing.canonical:
                queue.fail_queued(event_id, f"cannot be read: {exc}", 0)  # dead at once
            continue
        events.append((event_id, key, event))
    return events


class QueueRows:
    """Queued events, dead letters and seen message ids in the backend of ``backing``.

    ``holds(session_key)`` tells whether this process holds a lane's lease: on a shared store
    open for writing, :meth:`restore` reads only the lanes it holds."""

    def __init__(
        self,
        backing: Backing,
        writer: StoreWriter,
        config: GatewayConfig,
        plugins: HermesPluginManager,
        holds: Callable[[str], bool],
        *,
        read_only: bool,
    ) -> None:
        self._backing = backing
        self._writer = writer
        self._config = config
        self._plugins = plugins
        self._holds = holds
        self._read_only = read_only

    @serialised
    def add(self, session_key: str, event: MessageEvent) -> int | None:
        """Persist a queued event (and, for a human one, its platform message id as seen, in
        the same commit); its id, or None without the ``queue`` capability (queues are then
        memory-only). Raises :class:`MessageRedeliveredError` (nothing written) for a message
        seen before."""
        queue = self._backing.bound.queue
        if queue is None:
            return None
        payload = json.dumps(event.to_dict(), ensure_ascii=False)
        with self._backing.canonical:
            event_id = queue.add_queued(
                session_key, event.internal, event.bound_session_id, payload, _seen_id(event)
            )
        if event_id is None:
            raise MessageRedeliveredError("the platform delivered this message again")
        return event_id

    @serialised
    def fail(self, event_id: int | None, error: str) -> bool:
        """Count a failed start of a queued event's turn; True when it has now used its
        ``gateway.max_dispatch_attempts`` and is set aside as a dead letter."""
        queue = self._backing.bound.queue
        if queue is None or event_id is None:
            return False
        with self._backing.canonical:
            return queue.fail_queued(event_id, error, self._config.gateway.max_dispatch_attempts)

    @serialised
    def remove(self, event_ids: list[int]) -> int:
        """Delete discarded queued events."""
        queue = self._backing.bound.queue
        if queue is None or not event_ids:
            return 0
        with self._backing.canonical:
            return queue.remove_queued(event_ids)

    def restore(self, session_key: str | None = None) -> list[QueuedEvent]:
        """Every persisted queued event (id, key, event), oldest first (on a shared store
        open for writing, of the lanes this process holds), or those of ``session_key``;
        unreadable ones are skipped with a warning and left in place."""
        queue = self._backing.bound.queue
        if queue is None:
            return []
        with self._backing.canonical:
            if session_key is not None and not self._read_only:
                stored = queue.queued(session_key)  # the writer's connection: sees its batch
            elif session_key is not None:
                stored = [row for row in queue.queued() if row[1] == session_key]
            else:
                stored = [row for row in queue.queued() if self._read_only or self._holds(row[1])]
        return read_queued(stored, self._backing, self._plugins)

    def dead_letters(self) -> list[DeadLetter]:
        """Queued events set aside after failing to start, oldest first (``[]`` without the
        ``queue`` capability)."""
        queue = self._backing.bound.queue
        if queue is None:
            return []
        with self._backing.canonical:
            return queue.dead_letters()

    def prune_seen(self) -> int:
        """Forget platform message ids seen longer ago than ``gateway.redelivery_window_days``
        (housekeeping); the count. In batches of :data:`MAINTENANCE_BATCH` rows, each a writer
        step of its own, so that turns' steps run between them."""
        before = time.time() - self._config.gateway.redelivery_window_days * 86_400
        total = 0
        while (pruned := self._prune_seen_batch(before)) == MAINTENANCE_BATCH:
            total += pruned
        return total + pruned

    @serialised
    def _prune_seen_batch(self, before: float) -> int:
        queue = self._backing.bound.queue
        if queue is None:
            return 0
        with self._backing.canonical:
            return queue.prune_seen(before, MAINTENANCE_BATCH)


def _seen_id(event: MessageEvent) -> str | None:
    """The platform message id a human event is remembered by (None: nothing to remember)."""
    return str(event.message_id) if event.message_id and not event.internal else None
