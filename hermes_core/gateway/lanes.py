"""Lanes and turns: one task per busy lane runs its turns in order, each turn through the
:class:`~hermes_core.turns.pipeline.TurnPipeline` (begin, agent, finish, deliver, settle), then the
lane's queue; a turn's every stage is guarded so a failure never stops the lane.

A turn's steps are handed over with ``await store.submit(...)``: what ``store.arun`` does,
without its two coroutine layers on every turn."""

from __future__ import annotations

import asyncio
import functools
import logging
import operator

from hermes_core.domain.errors import LeaseLostError
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.gateway.agents import Agent, TurnRequest
from hermes_core.gateway.context import (
    build_session_context,
    build_session_context_prompt,
    prefix_sender,
)
from hermes_core.gateway.core import GatewayCore, Lane
from hermes_core.gateway.texts import (
    SUSPENDED_NOTICE,
    TURN_FAILED,
)
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import Turn
from hermes_core.turns.queue import EnqueueResult, QueuedItem

logger = logging.getLogger(__name__)

DISPATCH_RETRY_SECS = 2.0
"""Wait before a queued message whose turn failed to start is tried again (times attempts)."""

_source_values = operator.attrgetter(*SessionSource.model_fields)
"""A source's field values in field order (read in C, like hashing the tuple they go into)."""


class LaneRunner(GatewayCore):
    """Starts lane tasks and runs their turns."""

    def _take_head(self, key: str) -> QueuedItem | None:
        """Remove the lane's queue head, memory and row (writer step)."""
        item = self._queue.pop_head(key)
        if item is not None:
            self.store.queue_remove(item.row_ids)
        return item

    def _start_lane(
        self,
        key: str,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | EnqueueResult | None] | None = None,
    ) -> None:
        """A lane task that begins with ``first`` (an idle lane's message or an internal
        resume) or else the queue head; ``begun`` learns how storing ``first`` went."""
        lane = self._lanes[key] = Lane()
        lane.opening = begun is not None and self.shared is not None
        lane.task = asyncio.create_task(self._run_lane(key, lane, first, begun))

    def _dispatch_next(self, key: str) -> None:
        """Start the lane's queue head if the lane is idle (and not being taken over) and the
        gateway dispatches."""
        if self._busy(key) or key in self._retrying or self._gate or self._stopping is not None:
            return
        if self.shared is not None and self.shared.recovering(key):
            return  # the takeover dispatches the lane once its resumed turn has started
        head = self._queue.head(key)
        if self.shared is not None and not self.store.holds(key):
            if head is not None:
                self.shared.take(key)  # dispatched here once the lease is taken
            return
        if head is None:
            if self.shared is not None and key not in self._settling:
                self.shared.release(key)  # (a pending settle releases it or dispatches again)
            return
        if self._command(head.event)[0] is not None:
            self._commands[key] = asyncio.create_task(self._queued_command(key))
            return
        if self._connected(head.event.source.platform):
            self._start_lane(key, None)

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
                if lane.stop is not None or self._stopping is not None or self._gate:
                    return
                turn = await self._begin_next(key, None, None)
        finally:
            if self._lanes.get(key) is lane:
                del self._lanes[key]
                if lane.stop is None:
                    self._dispatch_next(key)  # a command at the head, or a retry to schedule

    async def _begin_next(
        self,
        key: str,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | EnqueueResult | None] | None,
    ) -> Turn | None:
        """Store the start of the lane's next turn: ``first`` (an idle lane's message, whose
        outcome ``begun`` reports to ``handle_message``, or an internal resume) or the queue
        head when it can be dispatched now; None when there is nothing to start. On a shared
        store an idle lane's message may be queued instead (see ``SharedLanes.open``): the
        lane's queue then runs wherever its lease is held."""
        if first is not None:
            try:
                if begun is not None and self.shared is not None:  # takes the lane's lease
                    opened = await self.shared.open(key, first, self._pipeline.begin)
                else:
                    opened = await self.store.submit(
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
                await self.store.arun(self._take_head, key, lane=key)
                continue
            if self.shared is not None and not self.store.holds(key):
                return None  # the settle released the lease: the lane is taken again first
            try:
                turn = await self.store.submit(self._begin_head, key, lane=key)
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

    def _startable(self, event: MessageEvent) -> bool:
        """Whether a queued event starts a turn now: not a command, its platform connected
        (it waits for it, never dropped)."""
        return self._command(event)[0] is None and self._connected(event.source.platform)

    def _begin_head(self, key: str) -> Turn | None:
        """Take the queue head and store its turn's start (writer step: one commit, which
        also deletes its rows); a redelivered head is dropped. None if nothing started. On a
        shared store the lane's durable queue is read first: events other processes queued
        for it since run in their durable order among this process's own (a head that is
        then a command, or waits for its platform, is left to the lane's dispatch)."""
        if self.shared is not None:
            self._reread(key)
            head = self._queue.head(key)
            if head is None or not self._startable(head.event):
                return None
        item = self._queue.pop_head(key)
        if item is None:
            return None
        turn = self._pipeline.begin(key, item.event, item.event_id)
        self.store.queue_remove(item.part_ids if turn is not None else item.row_ids)
        return turn

    async def _wake_current(self, key: str, event: MessageEvent) -> bool:
        """Whether an event may run now: a wake bound to an older session only if the host's
        resolver allows it."""
        bound = event.bound_session_id
        if not (event.internal and bound):
            return True
        if bound == await asyncio.to_thread(self.store.peek_session_id, key):
            return True
        resolver = self.callbacks.wake_allowed
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
            dead = await self.store.arun(self._fail_head, key, head, repr(error), lane=key)
        except Exception:
            logger.exception("the failed start could not be recorded")
            dead = False
        if dead:
            logger.error("a queued message was set aside as a dead letter after %d attempts",
                         head.attempts)  # fmt: skip
            if not head.event.internal:
                await self._reply(head.event.source, TURN_FAILED)
            return
        delay = DISPATCH_RETRY_SECS * max(1, head.attempts)
        self._retrying[key] = self._later(delay, functools.partial(self._retry_dispatch, key))

    def _retry_dispatch(self, key: str) -> None:
        self._retrying.pop(key, None)
        self._dispatch_next(key)

    def _fail_head(self, key: str, head: QueuedItem, error: str) -> bool:
        """Record a failed start of the head (writer step); True when it became a dead letter
        and left the queue."""
        head.attempts += 1
        dead = self.store.queue_fail(head.event_id, error)
        for part in head.part_ids:  # a burst's rows count their attempts together
            self.store.queue_fail(part, error)
        if head.event_id is None:  # held in memory only (degraded store)
            dead = head.attempts >= self.config.gateway.max_dispatch_attempts
        if dead and self._queue.head(key) is head:
            self._queue.pop_head(key)
        return dead

    async def _run_turn(self, lane: Lane, turn: Turn) -> None:
        """One begun turn: the agent on the loop, then the reply stored and recorded (one
        commit), sent, and settled with the turn closed (one commit)."""
        key = turn.key
        try:
            agent = self.cache.get_or_create(
                key, turn.entry.session_id, lambda: self.agent_factory(turn.entry),
                begin_turn=True,
            )  # fmt: skip
        except Exception:
            logger.exception("the lane's agent could not be built")
            await self._turn_failed(turn)
            return
        try:
            await self._agent_turn(lane, turn, agent)
        finally:
            self.cache.end_turn(key, agent)
            # The turn's user message and reply are in the store: nothing held only in memory.
            self.cache.report_persistence(key, agent, persisted=2, in_memory=2)

    async def _agent_turn(self, lane: Lane, turn: Turn, agent: Agent) -> None:
        lane.agent = agent
        reply: str | None = None
        failed = False
        lane.in_agent = lane.stop is None
        try:
            if lane.stop is not None:  # halted while the turn was being stored
                raise asyncio.CancelledError
            request = self._request(turn)
            if turn.suspended_before and not turn.event.internal:
                await self._reply(turn.event.source, SUSPENDED_NOTICE)
            reply = await agent.run_turn(request)
        except asyncio.CancelledError:
            if lane.stop == "user":  # stopped by the user: nothing owed, nothing to resume
                await self._close(turn, success=False)
            raise  # a drain keeps the marker: the turn resumes after the restart
        except Exception:
            logger.exception("a turn failed")
            failed = True
            await self._reply(turn.event.source, TURN_FAILED)
        finally:
            lane.in_agent = False
        success = not failed and not lane.interrupted
        try:
            owed = await self.store.submit(
                self._pipeline.finish, turn, None if failed else reply, success, lane=turn.key
            )
        except LeaseLostError as exc:  # another gateway took the lane over and resumes it
            logger.warning("a turn stopped without writing its reply: %s", exc)
            return
        except Exception:
            logger.exception("a turn's reply could not be stored")
            if not failed:
                await self._reply(turn.event.source, TURN_FAILED)
            await self._close(turn, success=False)
            return
        if owed is None:
            crash_point("marker_cleared")
            return
        crash_point("reply_stored")
        await self._deliver(owed.row, turn=turn, success=success, claimed=owed.ledgered)

    async def _turn_failed(self, turn: Turn) -> None:
        await self._reply(turn.event.source, TURN_FAILED)
        await self._close(turn, success=False)

    async def _close(self, turn: Turn, *, success: bool) -> None:
        """Close a turn that owes nothing; a store failure leaves its marker (logged), so the
        turn is resumed after the next restart rather than lost."""
        try:
            close = functools.partial(self.store.close_turn, success=success)
            await self.store.arun(close, turn.key, turn.token, lane=turn.key)
        except Exception:
            logger.exception("a turn could not be closed; its marker stays set")

    def _request(self, turn: Turn) -> TurnRequest:
        """The agent's input: the session-context prompt (cached per session and source: it is
        byte-identical from turn to turn) and the message; the history loads on demand."""
        source, session_id = turn.event.source, turn.entry.session_id
        # The source stands in the key as its field values (in field order): hashing and
        # comparing that tuple runs in C, a SessionSource's own __hash__ and __eq__ in Python.
        prompts, cache_key = self._prompts, (session_id, *_source_values(source))
        cached = prompts.use(cache_key)
        if cached is None:
            context = build_session_context(source, self.config, turn.entry, plugins=self.plugins)
            cached = (build_session_context_prompt(context, plugins=self.plugins), context)
            prompts.put(cache_key, cached)
        prompt, context = cached
        text = turn.event.text
        if context.shared_multi_user_session and not turn.event.internal:
            text = prefix_sender(text, source, context, plugins=self.plugins)
        store = self.store
        return TurnRequest(
            turn.key, session_id, prompt, turn.message(text), turn.event,
            lambda: store.load_transcript(session_id)[:-1],
        )  # fmt: skip
