"""An inbound event's way in: its lane's key, the redelivery check, then a command carried out,
or the event queued (behind the start-up gate, during a drain, on a busy lane) or its turn
started (:class:`Inbound`); running or queueing an accepted event, and what the sender is told
when it cannot be stored (:class:`Admission`, which the commands use too).

:class:`Inbound` returns once the event is durably stored (the turn's first commit for an idle
lane, the queue commit otherwise): the adapter may acknowledge it then. When it cannot be
stored, the sender is told and :class:`~hermes_core.domain.errors.MessageNotStoredError` is
raised, so the adapter leaves the message unacknowledged for the platform to deliver again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from cachetools import TTLCache

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent
from hermes_core.gateway.delivery import Platforms
from hermes_core.gateway.lanes import Lanes
from hermes_core.gateway.lifecycle import Phase
from hermes_core.gateway.texts import (
    ACK_INTERRUPT,
    ACK_INTERVAL_SECS,
    ACK_QUEUED,
    DRAIN_QUEUED,
    DRAIN_REFUSED,
    REFUSED_CAP,
    REFUSED_FULL,
    REFUSED_NOT_SAVED,
)
from hermes_core.store import SessionStore
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import Turn
from hermes_core.turns.queue import EnqueueResult, SeenMessages, TurnQueue

logger = logging.getLogger(__name__)

REFUSED_MEMORY_SECS = 3600.0
"""How long a refused platform message is remembered as told (its redeliveries go unanswered)."""

SEEN_MESSAGES = 10_000
"""How many (lane, platform message id) pairs are kept in memory in front of the store's
durable redelivery check; as many lanes keep their acknowledgement rate limit."""


class Admission:
    """Runs or queues an accepted event: an idle lane's turn starts at once, anything else is
    queued durably (and acknowledged, at most once per lane per ``ACK_INTERVAL_SECS``)."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        queue: TurnQueue,
        lanes: Lanes,
        platforms: Platforms,
        phase: Phase,
        seen: SeenMessages,
    ) -> None:
        self._config = config
        self._store = store
        self._queue = queue
        self._lanes = lanes
        self._platforms = platforms
        self._phase = phase
        self._seen = seen
        self._acked: TTLCache[str, bool] = TTLCache(maxsize=SEEN_MESSAGES, ttl=ACK_INTERVAL_SECS)
        self._refused: TTLCache[tuple[str, str, str], bool] = TTLCache(
            maxsize=SEEN_MESSAGES, ttl=REFUSED_MEMORY_SECS
        )
        """Platform messages whose sender was told they were not saved: a platform delivering
        one again during the same outage is refused without telling the sender again."""

    async def accept(self, key: str, event: MessageEvent) -> None:
        """Start the event's turn on an idle lane of a connected platform, else queue it (a
        busy lane's agent is interrupted first when ``display.busy_input_mode`` says so)."""
        lanes = self._lanes
        idle = not lanes.busy(key) and self._queue.depth(key) == 0
        if idle and self._platforms.connected(event.source.platform):
            await self._begin_idle(key, event)
            return
        result = await self.enqueue(key, event)
        if not result.accepted:
            return
        lane = lanes.get(key)
        if lane is None:
            lanes.dispatch_next(key)
            return
        if event.internal or result.merged:
            return
        interrupting = False
        if self._config.display.busy_input_mode == "interrupt" and lane.agent is not None:
            try:
                interrupting = await lane.agent.interrupt()
            except Exception:
                logger.exception("the agent failed to interrupt its turn")
            lane.interrupted = lane.interrupted or interrupting
        await self._ack(key, event, ACK_INTERRUPT if interrupting else ACK_QUEUED)

    async def _begin_idle(self, key: str, event: MessageEvent) -> None:
        """An idle lane: its task stores the turn's start, then runs it; this returns once the
        start is stored (a message arriving meanwhile queues behind this one, and a drain or
        ``/stop`` sees the lane from the first moment). The lane's ownership may queue the
        event instead (on a shared store: its lease is held elsewhere, or events wait in its
        durable queue)."""
        loop = asyncio.get_running_loop()
        begun: asyncio.Future[Turn | EnqueueResult | None] = loop.create_future()
        self._lanes.start(key, event, begun)
        try:
            turn = await begun  # cancelling this caller cancels ``begun`` only: the lane goes on
        except Exception as exc:  # noqa: BLE001 - whatever the cause, the message is not stored
            await self._not_stored(event, exc)
        if isinstance(turn, EnqueueResult):
            await self.enqueued(key, event, turn)
        elif turn is None:  # the platform delivered a message the lane already has
            logger.info("ignored a message delivered again")

    async def _not_stored(self, event: MessageEvent, cause: BaseException | None) -> NoReturn:
        """Tell the sender their message was not saved, then raise for the adapter."""
        logger.error("an inbound message could not be stored: %s", cause)
        source = event.source
        told = (source.platform, source.chat_id, event.message_id) if event.message_id else None
        if not event.internal and (told is None or told not in self._refused):
            if told is not None:
                self._refused[told] = True
            await self._platforms.reply(source, REFUSED_NOT_SAVED)
        raise MessageNotStoredError(
            "the message could not be stored; leave it unacknowledged so that the platform "
            f"delivers it again ({cause})"
        ) from cause

    async def enqueue(self, key: str, event: MessageEvent) -> EnqueueResult:
        """Queue an event durably; a refusal is answered (and raised when not saved)."""
        try:
            result = await self._store.arun(self._queue.enqueue, key, event, lane=key)
        except HermesError as exc:  # the store is closed or its commit failed twice
            await self._not_stored(event, exc)
        await self.enqueued(key, event, result)
        return result

    async def enqueued(self, key: str, event: MessageEvent, result: EnqueueResult) -> None:
        """After an enqueue: a refusal is answered (and raised when not saved)."""
        if result.refused == "duplicate":
            logger.info("ignored a message delivered again")
            self._seen.remember_event(key, event)
            return
        if result.refused in ("cap", "full"):
            if not event.internal:
                text = (
                    REFUSED_CAP.format(n=result.depth) if result.refused == "cap" else REFUSED_FULL
                )
                await self._platforms.reply(event.source, text)
            return
        if result.refused is not None:
            await self._not_stored(event, None)
        self._seen.remember_event(key, event)
        crash_point("enqueued")

    async def _ack(self, key: str, event: MessageEvent, text: str) -> None:
        """Acceptance acknowledgements: at most one per lane per 30 s, and only if enabled."""
        if not self._config.gateway.busy_ack_enabled or key in self._acked:
            return
        self._acked[key] = True  # expires after ACK_INTERVAL_SECS
        await self._platforms.reply(event.source, text)

    async def enqueue_while_draining(self, key: str, event: MessageEvent) -> None:
        """Queue an event during a drain, telling the sender it waits for the next start (or
        that it was refused)."""
        stopping = self._phase.stopping
        try:
            result = await self.enqueue(key, event)
        except MessageNotStoredError:
            if stopping is not None and not event.internal:
                await self._platforms.reply(event.source, DRAIN_REFUSED[stopping])
            raise
        if event.internal or stopping is None or result.refused == "duplicate":
            return
        texts = DRAIN_QUEUED if result.accepted else DRAIN_REFUSED
        await self._platforms.reply(event.source, texts[stopping])


class Inbound:
    """Takes an inbound event in: key, redelivery check, then a command, the queue or a turn."""

    def __init__(
        self,
        store: SessionStore,
        seen: SeenMessages,
        phase: Phase,
        admission: Admission,
        *,
        is_command: Callable[[MessageEvent], bool],
        run_command: Callable[[str, MessageEvent], Awaitable[None]],
    ) -> None:
        self._store = store
        self._seen = seen
        self._phase = phase
        self._admission = admission
        self._is_command = is_command
        self._run_command = run_command

    async def handle(self, event: MessageEvent) -> None:
        """Store an inbound event durably, then run or queue its turn (see the module); a
        message the lane already has (the platform delivering it again) is ignored."""
        key = self._store.session_key_for(event.source)
        if self._seen.seen_before(key, event):
            logger.info("ignored a message delivered again")
            return
        phase, admission = self._phase, self._admission
        if phase.stopping is not None:
            await admission.enqueue_while_draining(key, event)
            return
        if phase.gate:
            await admission.enqueue(key, event)  # no acknowledgement yet
            return
        if not event.internal and self._is_command(event):
            await self._run_command(key, event)
            return
        await admission.accept(key, event)
