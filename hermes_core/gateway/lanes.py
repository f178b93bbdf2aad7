"""The lanes: one task per busy lane runs its turns in order (each turn through ``run_turn``,
:class:`~hermes_core.gateway.runner.TurnRunner`), then the lane's queue; a command taken from a
lane's queue occupies the lane while it is carried out. A queued message whose turn failed to
start is tried again after a pause, and set aside as a dead letter at the limit.

A turn's steps are handed over with ``await store.submit(...)``: what ``store.arun`` does,
without its two coroutine layers on every turn."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import LeaseLostError
from hermes_core.domain.models import MessageEvent
from hermes_core.gateway.agents import Agent, HostCallbacks
from hermes_core.gateway.delivery import Platforms
from hermes_core.gateway.lifecycle import Background, Phase
from hermes_core.gateway.ownership import LaneOwnership
from hermes_core.gateway.texts import TURN_FAILED
from hermes_core.store import SessionStore
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import Turn, TurnPipeline
from hermes_core.turns.queue import EnqueueResult, QueuedItem, SeenMessages, TurnQueue

logger = logging.getLogger(__name__)

DISPATCH_RETRY_SECS = 2.0
"""Wait before a queued message whose turn failed to start is tried again (times attempts)."""


class Lane:
    """A lane with a turn task running (or about to: its first turn is being stored)."""

    task: asyncio.Task[None] | None = None
    agent: Agent | None = None
    stop: str | None = None
    """Why the lane is being stopped: ``user`` (/stop, /new, /reset) or ``drain``."""
    interrupted: bool = False
    in_agent: bool = False
    """Only the agent's part of a turn is cancelled: before it the marker is being written, after
    it the reply is being delivered, both short and both better finished."""
    opening: bool = False
    """Its first message is being stored (on a shared store, taking the lane's lease): no turn
    of it runs yet."""

    def halt(self, reason: str) -> None:
        """Stop after the current turn; cancel it if the agent is still working on it."""
        self.stop = reason
        if self.in_agent and self.task is not None:
            self.task.cancel()


class Lanes:
    """Starts lane tasks, dispatches each lane's queue (turns, and commands through
    ``queued_command``) and retries a queued message whose turn failed to start."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        queue: TurnQueue,
        pipeline: TurnPipeline,
        ownership: LaneOwnership,
        platforms: Platforms,
        phase: Phase,
        background: Background,
        seen: SeenMessages,
        callbacks: HostCallbacks,
        *,
        is_command: Callable[[MessageEvent], bool],
        run_turn: Callable[[Lane, Turn], Awaitable[None]],
        queued_command: Callable[[str], Awaitable[None]],
        idle: Callable[[str], None],
    ) -> None:
        self._config = config
        self._store = store
        self._queue = queue
        self._pipeline = pipeline
        self._ownership = ownership
        self._platforms = platforms
        self._phase = phase
        self._background = background
        self._seen = seen
        self._is_command = is_command
        self._callbacks = callbacks
        self._run_turn = run_turn
        self._queued_command = queued_command
        self._idle = idle
        """Told when a lane's task ended and nothing else started on it."""
        self._lanes: dict[str, Lane] = {}
        self._commands: dict[str, asyncio.Task[None]] = {}
        """Lanes whose queue head is a command being carried out (nothing else dispatches)."""
        self._resetting: set[str] = set()
        """Lanes a reset is moving to a new session (what arrives meanwhile is queued)."""
        self._retrying: dict[str, asyncio.TimerHandle] = {}
        """Lanes waiting to retry a queued message whose turn failed to start."""

    # -- what occupies a lane ------------------------------------------------------------------

    def busy(self, key: str) -> bool:
        """Whether a turn, a command or a reset occupies the lane."""
        return key in self._lanes or key in self._commands or key in self._resetting

    def get(self, key: str) -> Lane | None:
        """The lane's running task, if it has one."""
        return self._lanes.get(key)

    def commanded(self, key: str) -> bool:
        """Whether a command taken from the lane's queue is being carried out."""
        return key in self._commands

    def occupied(self) -> bool:
        """Whether any lane has a task or a command running."""
        return bool(self._lanes or self._commands)

    def turn_tasks(self) -> list[asyncio.Task[None]]:
        """The lanes' tasks."""
        return [lane.task for lane in self._lanes.values() if lane.task is not None]

    def command_tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of the commands being carried out."""
        return list(self._commands.values())

    def keys_of(self, tasks: Collection[asyncio.Future[Any]]) -> set[str]:
        """The lanes whose task is one of ``tasks``."""
        return {key for key, lane in self._lanes.items() if lane.task in tasks}

    def run_command(self, key: str, work: Callable[[], Awaitable[None]]) -> None:
        """Carry out a command taken from the lane's queue (``work``): nothing else is
        dispatched on the lane until it is done; then the lane is dispatched again."""
        self._commands[key] = asyncio.create_task(self._command(key, work))

    async def _command(self, key: str, work: Callable[[], Awaitable[None]]) -> None:
        try:
            await work()
        finally:
            self._commands.pop(key, None)
        self.dispatch_next(key)

    @contextlib.contextmanager
    def resetting(self, key: str) -> Iterator[None]:
        """While a reset moves the lane to a new session it counts as busy (what arrives is
        queued for the new session); then the lane is dispatched again."""
        self._resetting.add(key)
        try:
            yield
        finally:
            self._resetting.discard(key)
            self.dispatch_next(key)

    async def halt(self, key: str, reason: str) -> bool:
        """Hard-interrupt the lane's running turn; True if one was running."""
        lane = self._lanes.get(key)
        if lane is None or lane.task is None:
            return False
        lane.halt(reason)
        await asyncio.gather(lane.task, return_exceptions=True)
        return True

    def halt_all(self, reason: str) -> None:
        """Stop every lane after its current turn (see :meth:`Lane.halt`)."""
        for lane in list(self._lanes.values()):
            lane.halt(reason)

    async def mark_running(self, mode: str) -> bool:
        """Flag the lanes whose turn is still running (their marker still set when the flag is
        written) to resume after the restart; False if a flag could not be stored."""
        reason = f"{mode}_timeout"
        stored = True
        for key, lane in list(self._lanes.items()):
            if lane.task is None or lane.task.done():
                continue
            try:
                await self._store.arun(
                    functools.partial(self._store.mark_resume_pending, only_if_running=True),
                    key, reason, lane=key,
                )  # fmt: skip
            except Exception:
                logger.exception("a running turn could not be flagged to resume")
                stored = False
        return stored

    def stop_retrying(self) -> None:
        """A stop cancelled the timers: no queued message is tried again."""
        self._retrying.clear()

    # -- dispatch and the lane task ------------------------------------------------------------

    def start(
        self,
        key: str,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | EnqueueResult | None] | None = None,
    ) -> None:
        """A lane task that begins with ``first`` (an idle lane's message or an internal
        resume) or else the queue head; ``begun`` learns how storing ``first`` went."""
        lane = self._lanes[key] = Lane()
        lane.opening = begun is not None
        lane.task = asyncio.create_task(self._run_lane(key, lane, first, begun))

    def dispatch_next(self, key: str) -> None:
        """Start the lane's queue head if the lane is idle and the gateway dispatches, and the
        ownership lets it run here now."""
        if self.busy(key) or key in self._retrying or not self._phase.dispatching:
            return
        head = self._queue.head(key)
        if not self._ownership.claim(key, head is not None) or head is None:
            return
        if self._is_command(head.event):
            self.run_command(key, functools.partial(self._queued_command, key))
            return
        if self._platforms.connected(head.event.source.platform):
            self.start(key, None)

    async def _run_lane(
        self,
        key: str,
        lane: Lane,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | EnqueueResult | None] | None = None,
    ) -> None:
        """Run the lane's turns one after another until its queue has nothing dispatchable."""
        try:
            turn = await self._begin_next(key, first, begun)
            lane.opening = False
            while turn is not None:
                await self._run_turn(lane, turn)
                lane.interrupted = False
                if lane.stop is not None or not self._phase.dispatching:
                    return
                turn = await self._begin_next(key, None, None)
        finally:
            if self._lanes.get(key) is lane:
                del self._lanes[key]
                if lane.stop is None:
                    self.dispatch_next(key)  # a command at the head, or a retry to schedule
                    if not self.busy(key):
                        self._idle(key)

    async def _begin_next(
        self,
        key: str,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | EnqueueResult | None] | None,
    ) -> Turn | None:
        """Store the start of the lane's next turn: ``first`` (an idle lane's message, whose
        outcome ``begun`` reports to ``handle_message``, or an internal resume) or the queue
        head when it can be dispatched now; None when there is nothing to start. The ownership
        may queue an idle lane's message instead (see ``LaneOwnership.open``): the lane's queue
        then runs wherever the lane runs."""
        if first is not None:
            try:
                if begun is not None:
                    opened = await self._ownership.open(key, first, self._pipeline.begin)
                else:
                    opened = await self._store.submit(
                        self._pipeline.begin, key, first, None, lane=key
                    )
            except Exception as exc:
                if begun is None:
                    logger.exception("a resumed turn could not start; it resumes next start")
                elif not begun.done():
                    begun.set_exception(exc)
                return None
            if isinstance(opened, EnqueueResult):  # queued instead: the lane's queue runs it
                if begun is not None and not begun.done():
                    begun.set_result(opened)
                return None
            turn = opened
            if turn is not None:
                self._begun(key, first)
            if begun is not None and not begun.done():  # done: its caller was cancelled
                begun.set_result(turn)
            return turn
        while (head := self._queue.head(key)) is not None:
            if key in self._commands or key in self._resetting:
                return None  # nothing starts while a command is carried out on the lane
            if not self._startable(head.event):
                return None  # a command runs apart; a message waits for its platform
            if not await self._wake_current(key, head.event):
                logger.warning("dropped an internal wake bound to an earlier session")
                await self._store.arun(self._take_head, key, lane=key)
                continue
            if not self._ownership.holds(key):
                return None  # the settle let the lane go: it is taken again first
            try:
                turn = await self._store.submit(self._begin_head, key, lane=key)
            except LeaseLostError as exc:
                logger.warning("a lane's turn did not start: %s", exc)
                return None
            except Exception as exc:  # noqa: BLE001 - counted towards its dead-lettering
                await self._dispatch_failed(key, head, exc)
                return None
            if turn is not None:
                self._begun(key, turn.event)
                return turn
        return None

    def _begun(self, key: str, event: MessageEvent) -> None:
        """A turn's first commit is done."""
        self._seen.remember_event(key, event)
        crash_point("marker_written")

    def _startable(self, event: MessageEvent) -> bool:
        """Whether a queued event starts a turn now: not a command, its platform connected
        (it waits for it, never dropped)."""
        return not self._is_command(event) and self._platforms.connected(event.source.platform)

    def _take_head(self, key: str) -> QueuedItem | None:
        """Remove the lane's queue head, memory and row (writer step)."""
        item = self._queue.pop_head(key)
        if item is not None:
            self._store._queue.remove(item.row_ids)
        return item

    def _begin_head(self, key: str) -> Turn | None:
        """Take the queue head (as the ownership gives it: see ``LaneOwnership.pop_head``) and
        store its turn's start (writer step: one commit, which also deletes its rows); a
        redelivered head is dropped. None if nothing started."""
        item = self._ownership.pop_head(key, self._startable)
        if item is None:
            return None
        turn = self._pipeline.begin(key, item.event, item.event_id)
        self._store._queue.remove(item.part_ids if turn is not None else item.row_ids)
        return turn

    async def _wake_current(self, key: str, event: MessageEvent) -> bool:
        """Whether an event may run now: a wake bound to an older session only if the host's
        resolver allows it."""
        bound = event.bound_session_id
        if not (event.internal and bound):
            return True
        if bound == await asyncio.to_thread(self._store.peek_session_id, key):
            return True
        resolver = self._callbacks.wake_allowed
        if resolver is None:
            return False
        try:
            return bool(resolver(event, bound))
        except Exception:
            logger.exception("the wake resolver failed")
            return False

    async def _dispatch_failed(self, key: str, head: QueuedItem, error: Exception) -> None:
        """A queued event's turn could not start: count the attempt; at the limit set it aside
        as a dead letter (the sender is told), else try again after a pause."""
        logger.error("a queued message could not start its turn: %s", error)
        try:
            dead = await self._store.arun(self._fail_head, key, head, repr(error), lane=key)
        except Exception:
            logger.exception("the failed start could not be recorded")
            dead = False
        if dead:
            logger.error("a queued message was set aside as a dead letter after %d attempts",
                         head.attempts)  # fmt: skip
            if not head.event.internal:
                await self._platforms.reply(head.event.source, TURN_FAILED)
            return
        delay = DISPATCH_RETRY_SECS * max(1, head.attempts)
        retry = functools.partial(self._retry_dispatch, key)
        self._retrying[key] = self._background.later(delay, retry)

    def _retry_dispatch(self, key: str) -> None:
        self._retrying.pop(key, None)
        self.dispatch_next(key)

    def _fail_head(self, key: str, head: QueuedItem, error: str) -> bool:
        """Record a failed start of the head (writer step); True when it became a dead letter
        and left the queue."""
        head.attempts += 1
        dead = self._store._queue.fail(head.event_id, error)
        for part in head.part_ids:  # a burst's rows count their attempts together
            self._store._queue.fail(part, error)
        if head.event_id is None:  # held in memory only (degraded store)
            dead = head.attempts >= self._config.gateway.max_dispatch_attempts
        if dead and self._queue.head(key) is head:
            self._queue.pop_head(key)
        return dead
