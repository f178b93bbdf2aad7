"""The commands a lane obeys: ``/new`` and ``/reset`` (a new session), ``/stop`` and ``/queue``,
at once or when they reach the head of the queue."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from hermes_core.domain.commands import parse_command
from hermes_core.domain.errors import MessageNotStoredError
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.gateway.core import GatewayCore
from hermes_core.gateway.texts import (
    NEW_SESSION,
    NOTHING_TO_STOP,
    QUEUE_USAGE,
    QUEUED_COMMAND,
    STOPPED,
    TURN_FAILED,
)
from hermes_core.turns.queue import EnqueueResult, QueuedItem

logger = logging.getLogger(__name__)


class LaneCommands(GatewayCore):
    """Recognises and carries out lane commands."""

    def _command(self, event: MessageEvent) -> tuple[str | None, str]:
        """The command a human event carries (``/new``, ``/reset``, ``/stop``, ``/queue``);
        one addressed ``@name`` only if meant for this bot (``platforms.<name>.bot_username``)."""
        if event.internal or event.queued_via_command:
            return None, ""
        source = event.source
        platform = self.config.platforms.get(source.platform)
        return parse_command(
            event.text, (*self.triggers, "/stop", "/queue"),
            bot_username=platform.bot_username if platform is not None else None,
            direct=source.chat_type == "dm",
        )  # fmt: skip

    async def _run_command(self, key: str, event: MessageEvent, cut: float | None = None) -> None:
        """Carry out a command (``cut``: see :meth:`_carry_out`); a failure is logged and
        answered, never raised to the host."""
        shared = self.shared
        if shared is not None and (not self.store.holds(key) or shared.recovering(key)):
            # runs where the lane runs, after its takeover; a holder running a turn is woken
            result = await self._enqueue(key, event)
            if result.accepted:
                try:
                    await self.store.arun(self.store.wake_lane, key, lane=key)
                except Exception:  # noqa: BLE001 - the holder still runs it after its turn
                    logger.warning("could not wake the holder of a lane for a command")
                self._dispatch_next(key)
            return
        self._seen.remember_event(key, event)
        await self._carry_out(key, event, cut)

    def _woken(self, key: str) -> None:
        """Another process queued a command for the lane: if a turn of the lane runs here,
        under this process's lease, take the command out of the queue and carry it out now
        (``/stop`` interrupts the turn, as if it had arrived here). Or another process gave up
        the lane's lease with events queued (a clean stop): take the lane, to run them."""
        shared = self.shared
        if shared is None:
            return
        if key not in self._lanes and not self.store.holds(key) and not shared.recovering(key):
            if self._stopping is None and not self._gate:
                shared.take(key)  # refused (held elsewhere): its holder runs the queue
            return
        if key not in self._lanes or key in self._commands:
            return  # an idle lane runs its queued commands from the head, as usual
        if shared.recovering(key) or not self.store.holds(key):
            return
        take = functools.partial(self._take_first_command, key)
        self._commands[key] = asyncio.create_task(self._command_task(key, take, self._carry_out))

    def _take_first_command(self, key: str) -> tuple[MessageEvent, float] | None:
        """The first command to carry out queued for the lane, wherever it stands, taken (see
        :meth:`_take`) after the lane's durable queue is read again (writer step)."""
        self._reread(key)
        for item in self._queue.items(key):
            if self._is_command(item.event) and (taken := self._take(key, item)) is not None:
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
        it counts as before it), then let the lane go on."""
        try:
            taken = await self.store.arun(take, lane=key)
            if taken is not None:
                await run(key, *taken)
        except Exception:
            logger.exception("a queued command could not be carried out")
        finally:
            self._commands.pop(key, None)
        self._dispatch_next(key)

    async def _carry_out(self, key: str, event: MessageEvent, cut: float | None = None) -> None:
        """Carry out a command. ``cut`` orders it among the lane's queued items (a command
        taken from the queue: its own place); None for one that arrives now, after every item
        queued so far. A reset or ``/stop`` discards only items queued before it: what arrives
        after it, even while it waits for the running turn to stop, is kept and answered."""
        command, rest = self._command(event)
        try:
            if command in self.triggers:
                await self._reset(key, event, rest, cut)
                return
            if cut is None:
                cut = await self.store.arun(self._cut, key, lane=key)
            if command == "/stop":
                await self._stop_lane(key, event, cut)
            elif command == "/queue":
                await self._queue_command(key, event, rest)
        except MessageNotStoredError:
            raise
        except Exception:
            logger.exception("the command %s failed", command)
            await self._reply(event.source, TURN_FAILED)

    async def _halt(self, key: str, reason: str) -> bool:
        """Hard-interrupt the lane's running turn; True if one was running."""
        lane = self._lanes.get(key)
        if lane is None or lane.task is None:
            return False
        lane.halt(reason)
        await asyncio.gather(lane.task, return_exceptions=True)
        return True

    async def _interrupt_background(self, key: str) -> bool:
        interrupt = self.callbacks.interrupt_background
        if interrupt is None:
            return False
        session_id = await asyncio.to_thread(self.store.peek_session_id, key)
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
        self._reread(key)
        return self._queue.cut(key)

    async def _cut_reset(self, key: str, event: MessageEvent, rest: str) -> float:
        """A reset arrives: its cut of the lane's queue and, when text follows the trigger,
        that text queued right behind the cut in the same writer step, ahead of anything sent
        after the reset: the new session's first message."""
        if not rest.strip():
            return await self.store.arun(self._cut, key, lane=key)
        first = _first_message(event, rest)

        def cut_and_queue() -> tuple[int, EnqueueResult]:
            return self._cut(key), self._queue.enqueue(key, first)

        cut, result = await self.store.arun(cut_and_queue, lane=key)
        await self._enqueued(key, first, result)
        return cut

    async def _reset(self, key: str, event: MessageEvent, rest: str, cut: float | None) -> None:
        """Interrupt, discard the human items queued before it (``cut``: its place when it was
        queued, where :meth:`_take` left the text after the trigger; None: it arrives now, see
        :meth:`_cut_reset`), clean up the agent, new session, reply, then the lane's queue.
        Until then the lane counts as busy: what arrives meanwhile is queued for the new
        session."""
        self._resetting.add(key)
        try:
            if cut is None:
                cut = await self._cut_reset(key, event, rest)
            await self._halt(key, "user")
            await self._interrupt_background(key)
            await self.store.arun(self._queue.discard_humans, key, cut, lane=key)
            await asyncio.to_thread(self.cache.discard, key)  # full cleanup runs off the loop
            await self.store.arun(self._new_session, key, event.source, lane=key)
            await self._reply(event.source, NEW_SESSION)
        finally:
            self._resetting.discard(key)
            self._dispatch_next(key)

    def _new_session(self, key: str, source: SessionSource) -> None:
        """A new session on the lane and its stuck-loop count forgotten (one commit)."""
        store = self.store
        if store.reset_session(key) is None:
            store.get_or_create_session(source, True)
        store.counts.remove(key)

    async def _stop_lane(self, key: str, event: MessageEvent, cut: float) -> None:
        """``/stop``: interrupt the turn and background work, drop the slot's human follow-up
        if it was queued before it (``cut``), keep the overflow (``/queue`` items and internal
        wakes), say what happened."""
        stopped = await self._halt(key, "user")
        stopped = await self._interrupt_background(key) or stopped
        discarded = await self.store.arun(self._queue.discard_slot, key, cut, lane=key)
        if stopped or discarded:
            text = STOPPED
            if discarded:
                plural = "message" if discarded == 1 else "messages"
                text += f" Discarded {discarded} queued {plural}."
        else:
            text = NOTHING_TO_STOP
        await self._reply(event.source, text)
        self._dispatch_next(key)

    async def _queue_command(self, key: str, event: MessageEvent, prompt: str) -> None:
        """``/queue <prompt>``: one complete turn, in order, never merged."""
        if not prompt.strip() and not event.media_urls:
            await self._reply(event.source, QUEUE_USAGE)
            return
        if not self._busy(key) and self._queue.depth(key) == 0:
            await self._accept(key, event.replace(text=prompt))
            return
        result = await self._enqueue(key, event.replace(text=prompt, queued_via_command=True))
        if not result.accepted:
            return
        suffix = f" ({result.depth} queued)" if result.depth > 1 else ""
        await self._reply(event.source, QUEUED_COMMAND + suffix)
        if key not in self._lanes:
            self._dispatch_next(key)

    async def _queued_command(self, key: str) -> None:
        """A command that was queued (behind the start-up gate or a drain) reaches the head:
        take it out of the queue and carry it out."""
        await self._command_task(key, functools.partial(self._take_command, key), self._run_command)

    def _take_command(self, key: str) -> tuple[MessageEvent, float] | None:
        """Take the command at the head of the lane's queue (see :meth:`_take`), after the
        lane's durable queue is read again (writer step)."""
        self._reread(key)
        head = self._queue.head(key)
        return None if head is None else self._take(key, head)

    def _take(self, key: str, item: QueuedItem) -> tuple[MessageEvent, float] | None:
        """Take a queued command out to carry it out, with its place (writer step). A ``/queue
        <prompt>`` stays in its place as its prompt's own turn (its row is deleted when that
        turn starts): nothing to carry out. A reset's text after the trigger stays in the
        reset's place, so it runs first in the new session, before what was queued after it."""
        event = item.event
        command, rest = self._command(event)
        if command == "/queue" and (rest.strip() or event.media_urls):
            item.rewrite(event.replace(text=rest, queued_via_command=True))
            return None
        if command in self.triggers and rest.strip():
            item.rewrite(_first_message(event, rest))
            return event.replace(text=command), item.order
        self._queue.take(key, item)
        return event, item.order


def _first_message(reset: MessageEvent, rest: str) -> MessageEvent:
    """The text after a reset trigger as a message of its own: queued behind the reset, never
    read as a command or merged with a burst."""
    return reset.replace(text=rest, queued_via_command=True)
