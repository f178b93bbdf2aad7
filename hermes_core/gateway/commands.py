"""The commands a lane obeys: ``/new`` and ``/reset`` (a new session), ``/stop`` and ``/queue``,
at once or when they reach the head of the queue. :class:`CommandReader` tells which command an
event carries; :class:`Commands` carries them out."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.commands import parse_command
from hermes_core.domain.errors import MessageNotStoredError
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.gateway.agents import Agent, HostCallbacks
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.delivery import Platforms
from hermes_core.gateway.inbound import Admission
from hermes_core.gateway.lanes import Lanes
from hermes_core.gateway.ownership import LaneOwnership
from hermes_core.gateway.texts import (
    NEW_SESSION,
    NOTHING_TO_STOP,
    QUEUE_USAGE,
    QUEUED_COMMAND,
    STOPPED,
    TURN_FAILED,
)
from hermes_core.store import SessionStore
from hermes_core.turns.queue import EnqueueResult, QueuedItem, SeenMessages, TurnQueue

logger = logging.getLogger(__name__)


class CommandReader:
    """Which command an event carries, by the gateway's configuration (its reset triggers, the
    platforms' bot names)."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self.triggers = tuple(t.lower() for t in config.gateway.reset_triggers)

    def read(self, event: MessageEvent) -> tuple[str | None, str]:
        """The command a human event carries (``/new``, ``/reset``, ``/stop``, ``/queue``) and
        the text after it; one addressed ``@name`` only if meant for this bot
        (``platforms.<name>.bot_username``)."""
        if event.internal or event.queued_via_command:
            return None, ""
        source = event.source
        platform = self._config.platforms.get(source.platform)
        return parse_command(
            event.text, (*self.triggers, "/stop", "/queue"),
            bot_username=platform.bot_username if platform is not None else None,
            direct=source.chat_type == "dm",
        )  # fmt: skip

    def is_command(self, event: MessageEvent) -> bool:
        """Whether the event carries a command."""
        return self.read(event)[0] is not None


class Commands:
    """Carries out lane commands, where the lane runs."""

    def __init__(
        self,
        store: SessionStore,
        queue: TurnQueue,
        ownership: LaneOwnership,
        lanes: Lanes,
        admission: Admission,
        reader: CommandReader,
        seen: SeenMessages,
        cache: AgentCache[Agent],
        platforms: Platforms,
        callbacks: HostCallbacks,
    ) -> None:
        self._store = store
        self._queue = queue
        self._ownership = ownership
        self._lanes = lanes
        self._admission = admission
        self._reader = reader
        self._seen = seen
        self._cache = cache
        self._platforms = platforms
        self._callbacks = callbacks

    async def run(self, key: str, event: MessageEvent, cut: float | None = None) -> None:
        """Carry out a command (``cut``: see :meth:`_carry_out`) where the lane runs: one that
        runs elsewhere, or is being taken over here, gets the command queued (its runner is
        woken, and carries it out after its turn or takeover). A failure is logged and
        answered, never raised to the host."""
        ownership = self._ownership
        if not ownership.holds(key) or ownership.recovering(key):
            result = await self._admission.enqueue(key, event)
            if result.accepted:
                await ownership.wake(key)
                self._lanes.dispatch_next(key)
            return
        self._seen.remember_event(key, event)
        await self._carry_out(key, event, cut)

    def woken(self, key: str) -> None:
        """A command was queued for a lane this process runs (by another process): if a turn
        of the lane runs here, take the command out of the queue and carry it out now
        (``/stop`` interrupts the turn, as if it had arrived here); an idle lane runs its
        queued commands from the head, as usual."""
        lanes = self._lanes
        if lanes.get(key) is None or lanes.commanded(key):
            return
        take = functools.partial(self._take_first_command, key)
        lanes.run_command(key, functools.partial(self._command_task, key, take, self._carry_out))

    def queued(self, key: str) -> Coroutine[Any, Any, None]:
        """A command that was queued (behind the start-up gate or a drain) reaches the head:
        take it out of the queue and carry it out."""
        return self._command_task(key, functools.partial(self._take_command, key), self.run)

    def _take_first_command(self, key: str) -> tuple[MessageEvent, float] | None:
        """The first command to carry out queued for the lane, wherever it stands, taken (see
        :meth:`_take`) after the lane's durable queue is read again (writer step)."""
        self._ownership.reread(key)
        for item in self._queue.items(key):
            if self._reader.is_command(item.event) and (taken := self._take(key, item)) is not None:
                return taken
        return None

    async def _command_task(
        self,
        key: str,
        take: Callable[[], tuple[MessageEvent, float] | None],
        run: Callable[[str, MessageEvent, float], Awaitable[None]],
    ) -> None:
        """The task of a command taken out of the lane's queue (``take``, a writer step, gives
        it with its place in the queue): carry it out with ``run`` (only what was queued before
        it counts as before it); the lane goes on afterwards (see ``Lanes.run_command``)."""
        try:
            taken = await self._store.arun(take, lane=key)
            if taken is not None:
                await run(key, *taken)
        except Exception:
            logger.exception("a queued command could not be carried out")

    async def _carry_out(self, key: str, event: MessageEvent, cut: float | None = None) -> None:
        """Carry out a command. ``cut`` orders it among the lane's queued items (a command
        taken from the queue: its own place); None for one that arrives now, after every item
        queued so far. A reset or ``/stop`` discards only items queued before it: what arrives
        after it, even while it waits for the running turn to stop, is kept and answered."""
        command, rest = self._reader.read(event)
        try:
            if command in self._reader.triggers:
                await self._reset(key, event, rest, cut)
                return
            if cut is None:
                cut = await self._store.arun(self._cut, key, lane=key)
            if command == "/stop":
                await self._stop_lane(key, event, cut)
            elif command == "/queue":
                await self._queue_command(key, event, rest)
        except MessageNotStoredError:
            raise
        except Exception:
            logger.exception("the command %s failed", command)
            await self._platforms.reply(event.source, TURN_FAILED)

    async def _interrupt_background(self, key: str) -> bool:
        interrupt = self._callbacks.interrupt_background
        if interrupt is None:
            return False
        session_id = await asyncio.to_thread(self._store.peek_session_id, key)
        if session_id is None:
            return False
        try:
            return bool(interrupt(key, session_id))
        except Exception:
            logger.exception("interrupting background work failed")
            return False

    def _cut(self, key: str) -> int:
        """A command arrives (writer step): its cut of the lane's queue (see
        ``TurnQueue.cut``), after the lane's durable queue is read again, so that what other
        processes queued before it counts as before it."""
        self._ownership.reread(key)
        return self._queue.cut(key)

    async def _cut_reset(self, key: str, event: MessageEvent, rest: str) -> float:
        """A reset arrives: its cut of the lane's queue and, when text follows the trigger,
        that text queued right behind the cut in the same writer step, ahead of anything sent
        after the reset: the new session's first message."""
        if not rest.strip():
            return await self._store.arun(self._cut, key, lane=key)
        first = _first_message(event, rest)

        def cut_and_queue() -> tuple[int, EnqueueResult]:
            return self._cut(key), self._queue.enqueue(key, first)

        cut, result = await self._store.arun(cut_and_queue, lane=key)
        await self._admission.enqueued(key, first, result)
        return cut

    async def _reset(self, key: str, event: MessageEvent, rest: str, cut: float | None) -> None:
        """Interrupt, discard the human items queued before it (``cut``: its place when it was
        queued, where :meth:`_take` left the text after the trigger; None: it arrives now, see
        :meth:`_cut_reset`), clean up the agent, new session, reply, then the lane's queue.
        Until then the lane counts as busy: what arrives meanwhile is queued for the new
        session."""
        with self._lanes.resetting(key):
            if cut is None:
                cut = await self._cut_reset(key, event, rest)
            await self._lanes.halt(key, "user")
            await self._interrupt_background(key)
            await self._store.arun(self._queue.discard_humans, key, cut, lane=key)
            await asyncio.to_thread(self._cache.discard, key)  # full cleanup runs off the loop
            await self._store.arun(self._new_session, key, event.source, lane=key)
            await self._platforms.reply(event.source, NEW_SESSION)

    def _new_session(self, key: str, source: SessionSource) -> None:
        """A new session on the lane and its stuck-loop count forgotten (one commit)."""
        store = self._store
        if store.reset_session(key) is None:
            store.get_or_create_session(source, True)
        store._counts.current.remove(key)

    async def _stop_lane(self, key: str, event: MessageEvent, cut: float) -> None:
        """``/stop``: interrupt the turn and background work, drop the slot's human follow-up
        if it was queued before it (``cut``), keep the overflow (``/queue`` items and internal
        wakes), say what happened."""
        stopped = await self._lanes.halt(key, "user")
        stopped = await self._interrupt_background(key) or stopped
        discarded = await self._store.arun(self._queue.discard_slot, key, cut, lane=key)
        if stopped or discarded:
            text = STOPPED
            if discarded:
                plural = "message" if discarded == 1 else "messages"
                text += f" Discarded {discarded} queued {plural}."
        else:
            text = NOTHING_TO_STOP
        await self._platforms.reply(event.source, text)
        self._lanes.dispatch_next(key)

    async def _queue_command(self, key: str, event: MessageEvent, prompt: str) -> None:
        """``/queue <prompt>``: one complete turn, in order, never merged."""
        if not prompt.strip() and not event.media_urls:
            await self._platforms.reply(event.source, QUEUE_USAGE)
            return
        lanes, admission = self._lanes, self._admission
        if not lanes.busy(key) and self._queue.depth(key) == 0:
            await admission.accept(key, event.replace(text=prompt))
            return
        result = await admission.enqueue(key, event.replace(text=prompt, queued_via_command=True))
        if not result.accepted:
            return
        suffix = f" ({result.depth} queued)" if result.depth > 1 else ""
        await self._platforms.reply(event.source, QUEUED_COMMAND + suffix)
        if lanes.get(key) is None:
            lanes.dispatch_next(key)

    def _take_command(self, key: str) -> tuple[MessageEvent, float] | None:
        """Take the command at the head of the lane's queue (see :meth:`_take`), after the
        lane's durable queue is read again (writer step)."""
        self._ownership.reread(key)
        head = self._queue.head(key)
        return None if head is None else self._take(key, head)

    def _take(self, key: str, item: QueuedItem) -> tuple[MessageEvent, float] | None:
        """Take a queued command out to carry it out, with its place (writer step). A ``/queue
        <prompt>`` stays in its place as its prompt's own turn (its row is deleted when that
        turn starts): nothing to carry out. A reset's text after the trigger stays in the
        reset's place, so it runs first in the new session, before what was queued after it."""
        event = item.event
        command, rest = self._reader.read(event)
        if command == "/queue" and (rest.strip() or event.media_urls):
            item.rewrite(event.replace(text=rest, queued_via_command=True))
            return None
        if command in self._reader.triggers and rest.strip():
            item.rewrite(_first_message(event, rest))
            return event.replace(text=command), item.order
        self._queue.take(key, item)
        return event, item.order


def _first_message(reset: MessageEvent, rest: str) -> MessageEvent:
    """The text after a reset trigger as a message of its own: queued behind the reset, never
    read as a command or merged with a burst."""
    return reset.replace(text=rest, queued_via_command=True)
