"""The asyncio runtime: one ``Gateway`` per process.

Turns of one session key never overlap; turns of different keys run concurrently. Every store
write runs on the store's writer thread (``store.arun``), where concurrent lanes' steps share a
commit, so the event loop never waits on a lock, the disk or the network; reads that may touch
the disk run in worker threads. Messages that arrive while a lane is busy, during the start-up
gate or during a drain are queued durably and dispatched in order.

The acknowledgement contract: :meth:`Gateway.handle_message` returns once the event is durably
stored (the turn's first commit for an idle lane, the queue commit otherwise); an adapter may
then acknowledge the platform's message. When it cannot be stored, the sender is told and
:class:`~hermes_core.errors.MessageNotStoredError` is raised, so the adapter leaves the message
unacknowledged for the platform to deliver again. Every later stage of a turn is guarded: a
failure sends the "something went wrong" notice, keeps the stored state consistent, is logged
once and never stops the lane.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NoReturn

from cachetools import LRUCache, TTLCache

from hermes_core.agents import Adapter, Agent, TurnRequest
from hermes_core.cache import AgentCache
from hermes_core.config import GatewayConfig
from hermes_core.context import build_session_context, build_session_context_prompt, prefix_sender
from hermes_core.crashpoints import crash_point
from hermes_core.errors import HermesError, LeaseLostError, MessageNotStoredError
from hermes_core.gateway_texts import (
    ACK_INTERRUPT,
    ACK_INTERVAL_SECS,
    ACK_QUEUED,
    DRAIN_QUEUED,
    DRAIN_REFUSED,
    NEW_SESSION,
    NOTHING_TO_STOP,
    QUEUE_USAGE,
    QUEUED_COMMAND,
    REFUSED_CAP,
    REFUSED_NOT_SAVED,
    STOPPED,
    SUSPENDED_NOTICE,
    TURN_FAILED,
    HostCallbacks,
    parse_command,
)
from hermes_core.housekeeping import Housekeeping
from hermes_core.ledger import Occasion, SendResult
from hermes_core.models import MessageEvent, SessionContext, SessionEntry, SessionSource
from hermes_core.pipeline import Turn, TurnPipeline
from hermes_core.plugins import HermesPluginManager, default_plugin_manager
from hermes_core.queue import EnqueueResult, QueuedItem, SeenMessages, TurnQueue
from hermes_core.recovery import GatewayState
from hermes_core.resume import resume_candidates, resume_event
from hermes_core.sharing import SharedLanes
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation
from hermes_core.store.turns import AUTO_RESUME_REASONS

logger = logging.getLogger(__name__)

SEEN_MESSAGES = 10_000
"""How many (lane, platform message id) pairs are kept in memory in front of the store's
durable redelivery check."""
PROMPT_CACHE_SIZE = 1024
DISPATCH_RETRY_SECS = 2.0
"""Wait before a queued message whose turn failed to start is tried again (times attempts)."""
RATE_LIMIT_RETRY_SECS = 5.0
"""Wait before a rate-limited reply is sent again (times its attempts so far)."""

AgentFactory = Callable[[SessionEntry], Agent]


def _delivered() -> None:
    """After a delivery's settle commit: the row is gone, the turn closed."""
    crash_point("delivered")
    crash_point("marker_cleared")


class _Lane:
    """A lane with a turn task running (or about to: its first turn is being stored)."""

    task: asyncio.Task[None] | None = None
    agent: Agent | None = None
    stop: str | None = None
    """Why the lane is being stopped: ``user`` (/stop, /new, /reset) or ``drain``."""
    interrupted: bool = False
    in_agent: bool = False
    """Only the agent's part of a turn is cancelled: before it the marker is being written, after
    it the reply is being delivered, both short and both better finished."""

    def halt(self, reason: str) -> None:
        """Stop after the current turn; cancel it if the agent is still working on it."""
        self.stop = reason
        if self.in_agent and self.task is not None:
            self.task.cancel()


class Gateway:
    """Runs turns for inbound events: recovery at start, queueing, commands, drain at stop."""

    def __init__(
        self,
        config: GatewayConfig,
        plugins: HermesPluginManager | None,
        agent_factory: AgentFactory,
        adapters: Sequence[Adapter],
        *,
        callbacks: HostCallbacks | None = None,
    ) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else default_plugin_manager(config)
        self.agent_factory = agent_factory
        self.adapters = {adapter.platform: adapter for adapter in adapters}
        self.callbacks = callbacks or HostCallbacks()
        self.triggers = tuple(t.lower() for t in config.gateway.reset_triggers)
        self.cache: AgentCache[Agent] = AgentCache(
            config, soft_release=lambda agent: agent.soft_release(),
            full_cleanup=lambda agent: agent.cleanup(), policy=self.plugins.eviction_policy(),
            notify=self.plugins.notify if self.plugins.observing else None,
        )  # fmt: skip
        self.state = GatewayState(
            config, plugins=self.plugins,
            has_active_processes_fn=self.callbacks.has_active_processes,
            diagnostic_muted=self.callbacks.diagnostic_muted, queue_restore=self._restore_queue,
        )  # fmt: skip
        self.queue: TurnQueue | None = None
        self.pipeline: TurnPipeline | None = None
        self.shared: SharedLanes | None = None
        """Set on a store shared with other gateway processes (see ``sharing``)."""
        self._lanes: dict[str, _Lane] = {}
        self._commands: dict[str, asyncio.Task[None]] = {}
        """Lanes whose queue head is a command being carried out (nothing else dispatches)."""
        self._retrying: dict[str, asyncio.TimerHandle] = {}
        """Lanes waiting to retry a queued message whose turn failed to start."""
        self._timers: set[asyncio.TimerHandle] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._sending: set[str] = set()
        """Ledger rows being sent right now (never sent twice at once)."""
        self._gate = True
        self._stopping: str | None = None
        self._ready = asyncio.Event()
        self._acked: TTLCache[str, bool] = TTLCache(maxsize=SEEN_MESSAGES, ttl=ACK_INTERVAL_SECS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._housekeeping: Housekeeping | None = None
        self._seen = SeenMessages(SEEN_MESSAGES)
        self._prompts: LRUCache[tuple[str, SessionSource], tuple[str, SessionContext]] = LRUCache(
            maxsize=PROMPT_CACHE_SIZE
        )
        self._unadapted: set[str] = set()
        """Platforms without an adapter whose events were already warned about."""
        self._stop_task: asyncio.Task[bool] | None = None
        self._cut_drain = asyncio.Event()
        """Set to end a running drain at once, as if its time had run out."""

    async def __aenter__(self) -> Gateway:
        """``async with Gateway(...) as gateway:`` starts it and stops it (with a drain)."""
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def serve(self) -> bool:
        """Run until SIGINT or SIGTERM (Unix), then stop with a drain; returns what ``stop``
        returns. Starts the gateway unless it is started already. A second signal during the
        drain interrupts the turns still running at once (they resume after the next start)."""
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()

        def on_signal(signum: signal.Signals) -> None:
            if signalled.is_set():
                logger.warning("%s again: interrupting the running turns", signum.name)
                self._cut_drain.set()
                return
            logger.info("%s: stopping after the running turns (send it again to hurry)",
                        signum.name)  # fmt: skip
            signalled.set()

        handled = (signal.SIGINT, signal.SIGTERM)
        for signum in handled:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            if self._loop is None:
                await self.start()
            await signalled.wait()
            return await self.stop()
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    # -- start ---------------------------------------------------------------------------------

    @property
    def store(self) -> SessionStore:
        """The open store (after ``start``)."""
        if self.state.store is None:
            raise HermesError("the gateway is not started; await gateway.start() first")
        return self.state.store

    def _restore_queue(self) -> int:
        """The ``queue_restore`` recovery step (in start's worker thread): the queue is made
        visible only once restored, so nothing enqueued meanwhile is restored twice."""
        queue = TurnQueue(self.store, self.config, notify=self._notify)
        restored = queue.restore()
        for key in queue.lanes():
            for item in queue.items(key):
                self._seen.remember_event(key, item.event)
        self.queue = queue
        return restored

    @property
    def _notify(self) -> Callable[[Any], None] | None:
        return self.plugins.notify if self.plugins.observing else None

    async def start(self) -> None:
        """Lock, store, recovery steps under the gate; ledger sweep; auto-resume;
        lower the gate when the resumed turns end (or the wait expires); housekeeping."""
        self._loop = asyncio.get_running_loop()
        try:
            store = await asyncio.to_thread(self.state.start)
            self.pipeline = TurnPipeline(store, self.config)
            if self.queue is None:  # the queue_restore step was disabled
                self.queue = TurnQueue(store, self.config, notify=self._notify)
        finally:
            self._ready.set()  # messages waiting for the queue go on (or fail, if start did)
        connected = [name for name, adapter in self.adapters.items() if adapter.is_connected()]
        await self._send_due("boot", connected)
        await self._resume(None)
        await self._resumed(self.config.gateway.startup_restore_timeout_secs)
        self._gate = False
        if store.shared:
            self.shared = SharedLanes(
                self.config, store, self._queue, dispatch=self._dispatch_next,
                take_over=self._take_over, diagnostic_muted=self.callbacks.diagnostic_muted,
            )  # fmt: skip
            self.shared.start()
        for key in self._queue.lanes():
            self._dispatch_next(key)
        for key in store.held_lanes():  # recovered lanes with nothing left to run go back
            self._dispatch_next(key)
        self._housekeeping = Housekeeping(self.config, store, self.cache)
        self._housekeeping.start()

    async def _resumed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the resumed turns have ended, their last
        commit (the settle of their reply) included."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        resuming = [lane.task for lane in self._lanes.values() if lane.task is not None]
        if resuming:
            await asyncio.wait(resuming, timeout=timeout)
        settling = list(self._background)  # the settles the resumed turns left
        if settling and deadline > loop.time():
            await asyncio.wait(settling, timeout=deadline - loop.time())

    async def _resume(self, platform: str | None) -> int:
        """Start one internal resume turn per eligible lane."""
        entries = await asyncio.to_thread(
            functools.partial(
                resume_candidates, self.store, self.config.agent.gateway_auto_continue_freshness,
                platform=platform, connected=self._connected, busy=self._busy,
                authorised=self.callbacks.authorised,
            )
        )  # fmt: skip
        for entry in entries:
            if not self._busy(entry.session_key):
                self._start_lane(entry.session_key, resume_event(entry))
        return len(entries)

    async def _take_over(self, key: str) -> None:
        """A lane whose holder let its lease expire, now held here: recover it once, send what
        it owes (marked where it may be a duplicate), resume its interrupted turn once, then
        run its queue (see ``sharing``)."""
        shared = self.shared
        if shared is None or self._busy(key):
            return
        await asyncio.to_thread(shared.recover, key)
        connected = [name for name, adapter in self.adapters.items() if adapter.is_connected()]
        await self._send_due("boot", connected, key.__eq__)
        entry = await asyncio.to_thread(self.store.lookup_by_session_key, key)
        origin = entry.origin if entry is not None else None
        if (
            entry is not None and origin is not None and entry.resume_pending
            and not entry.suspended and entry.resume_reason in AUTO_RESUME_REASONS
            and self._connected(origin.platform) and not self._busy(key)
        ):  # fmt: skip
            self._start_lane(key, resume_event(entry))
            return
        self._dispatch_next(key)

    async def platform_connected(self, platform: str) -> None:
        """After (re)connecting a platform: send its owed replies, resume its lanes and
        dispatch the queue heads that waited for it."""
        await self._send_due("reconnect", [platform])
        await self._resume(platform)
        for key in self._queue.lanes():
            self._dispatch_next(key)

    # -- inbound ---------------------------------------------------------------------------------

    @property
    def _pipeline(self) -> TurnPipeline:
        if self.pipeline is None:
            raise HermesError("the gateway is not started; await gateway.start() first")
        return self.pipeline

    @property
    def _queue(self) -> TurnQueue:
        if self.queue is None:
            raise HermesError("the gateway is not started; await gateway.start() first")
        return self.queue

    def _connected(self, platform: str) -> bool:
        adapter = self.adapters.get(platform)
        return adapter is not None and adapter.is_connected()

    def _busy(self, key: str) -> bool:
        return key in self._lanes or key in self._commands

    async def handle_message(self, event: MessageEvent) -> None:
        """Store an inbound event durably, then run or queue its turn.

        Returns once the event is stored: the adapter may acknowledge it then. A message the
        lane already has (the platform delivering it again) is ignored. Raises
        :class:`MessageNotStoredError` when it could not be stored (the sender was told):
        leave it unacknowledged so that the platform delivers it again.
        """
        if not self._ready.is_set():
            if self._loop is None:
                raise HermesError("the gateway is not started; await gateway.start() first")
            await self._ready.wait()  # start-up has not restored the queue yet
        platform = event.source.platform
        if platform not in self.adapters and platform not in self._unadapted:
            self._unadapted.add(platform)
            logger.warning(
                "no adapter for platform %r: its messages are stored and queued but not answered "
                "until the gateway is built with an adapter for it", platform,
            )  # fmt: skip
        key = self.store.session_key_for(event.source)
        if self._seen.seen_before(key, event):
            logger.info("ignored a message delivered again")
            return
        if self._stopping is not None:
            await self._enqueue_while_draining(key, event)
            return
        if self._gate:
            await self._enqueue(key, event)  # no acknowledgement yet
            return
        if not event.internal and self._command(event)[0] is not None:
            await self._run_command(key, event)
            return
        await self._accept(key, event)

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

    async def _accept(self, key: str, event: MessageEvent) -> None:
        idle = not self._busy(key) and self._queue.depth(key) == 0
        if idle and self._connected(event.source.platform) and self.shared is None:
            await self._begin_idle(key, event)
            return
        result = await self._enqueue(key, event)
        if not result.accepted:
            return
        lane = self._lanes.get(key)
        if lane is None:
            self._dispatch_next(key)
            return
        if event.internal or result.merged:
            return
        interrupting = False
        if self.config.display.busy_input_mode == "interrupt" and lane.agent is not None:
            try:
                interrupting = await lane.agent.interrupt()
            except Exception:
                logger.exception("the agent failed to interrupt its turn")
            lane.interrupted = lane.interrupted or interrupting
        await self._ack(key, event, ACK_INTERRUPT if interrupting else ACK_QUEUED)

    async def _begin_idle(self, key: str, event: MessageEvent) -> None:
        """An idle lane: its task stores the turn's start, then runs it; this returns once the
        start is stored (a message arriving meanwhile queues behind this one, and a drain or
        ``/stop`` sees the lane from the first moment)."""
        begun: asyncio.Future[Turn | None] = asyncio.get_running_loop().create_future()
        self._start_lane(key, event, begun)
        try:
            turn = await asyncio.shield(begun)
        except Exception as exc:  # noqa: BLE001 - whatever the cause, the message is not stored
            await self._not_stored(event, exc)
        if turn is None:  # the platform delivered a message the lane already has
            logger.info("ignored a message delivered again")

    def _begun(self, key: str, event: MessageEvent) -> None:
        """A turn's first commit is done."""
        self._seen.remember_event(key, event)
        crash_point("marker_written")
        crash_point("user_stored")

    async def _not_stored(self, event: MessageEvent, cause: BaseException | None) -> NoReturn:
        """Tell the sender their message was not saved, then raise for the adapter."""
        logger.error("an inbound message could not be stored: %s", cause)
        if not event.internal:
            await self._reply(event.source, REFUSED_NOT_SAVED)
        raise MessageNotStoredError(
            "the message could not be stored; leave it unacknowledged so that the platform "
            f"delivers it again ({cause})"
        ) from cause

    async def _enqueue(self, key: str, event: MessageEvent) -> EnqueueResult:
        """Queue an event durably; a refusal is answered (and raised when not saved)."""
        try:
            result = await self.store.arun(self._queue.enqueue, key, event)
        except HermesError as exc:  # the store is closed or its commit failed twice
            await self._not_stored(event, exc)
        if result.refused == "duplicate":
            logger.info("ignored a message delivered again")
            self._seen.remember_event(key, event)
            return result
        if result.refused == "cap":
            if not event.internal:
                await self._reply(event.source, REFUSED_CAP.format(n=result.depth))
            return result
        if result.refused is not None:
            await self._not_stored(event, None)
        self._seen.remember_event(key, event)
        crash_point("enqueued")
        return result

    async def _ack(self, key: str, event: MessageEvent, text: str) -> None:
        """Acceptance acknowledgements: at most one per lane per 30 s, and only if enabled."""
        if not self.config.gateway.busy_ack_enabled or key in self._acked:
            return
        self._acked[key] = True  # expires after ACK_INTERVAL_SECS
        await self._reply(event.source, text)

    async def _enqueue_while_draining(self, key: str, event: MessageEvent) -> None:
        stopping = self._stopping
        try:
            result = await self._enqueue(key, event)
        except MessageNotStoredError:
            if stopping is not None and not event.internal:
                await self._reply(event.source, DRAIN_REFUSED[stopping])
            raise
        if event.internal or stopping is None or result.refused == "duplicate":
            return
        texts = DRAIN_QUEUED if result.accepted else DRAIN_REFUSED
        await self._reply(event.source, texts[stopping])

    # -- commands ----------------------------------------------------------------------------------

    async def _run_command(self, key: str, event: MessageEvent) -> None:
        """Carry out a command; a failure is logged and answered, never raised to the host."""
        command, rest = self._command(event)
        if self.shared is not None and not self.store.holds(key):  # runs where the lane runs
            result = await self._enqueue(key, event)
            if result.accepted:
                self._dispatch_next(key)
            return
        self._seen.remember_event(key, event)
        try:
            if command in self.triggers:
                await self._reset(key, event, rest)
            elif command == "/stop":
                await self._stop_lane(key, event)
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

    async def _reset(self, key: str, event: MessageEvent, rest: str) -> None:
        """Interrupt, discard human items, clean up the agent, new session, reply."""
        await self._halt(key, "user")
        await self._interrupt_background(key)
        await self.store.arun(self._queue.discard_humans, key)
        await asyncio.to_thread(self.cache.discard, key)  # full cleanup runs off the loop
        await self.store.arun(self._new_session, key, event.source)
        await self._reply(event.source, NEW_SESSION)
        if rest.strip():
            await self._enqueue(key, event.replace(text=rest))
        self._dispatch_next(key)

    def _new_session(self, key: str, source: SessionSource) -> None:
        """A new session on the lane and its stuck-loop count forgotten (one commit)."""
        store = self.store
        if store.reset_session(key) is None:
            store.get_or_create_session(source, True)
        store.counts.remove(key)

    async def _stop_lane(self, key: str, event: MessageEvent) -> None:
        """``/stop``: interrupt the turn and background work, drop the slot's human
        follow-up, keep the overflow (``/queue`` items and internal wakes), say what happened."""
        stopped = await self._halt(key, "user")
        stopped = await self._interrupt_background(key) or stopped
        discarded = await self.store.arun(self._queue.discard_slot, key)
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
        try:
            item = await self.store.arun(self._take_head, key)
            if item is not None:
                await self._run_command(key, item.event)
        except Exception:
            logger.exception("a queued command could not be carried out")
        finally:
            self._commands.pop(key, None)
        self._dispatch_next(key)

    def _take_head(self, key: str) -> QueuedItem | None:
        """Remove the lane's queue head, memory and row (writer step)."""
        item = self._queue.pop_head(key)
        if item is not None:
            self.store.queue_remove(item.row_ids)
        return item

    # -- lanes and turns ---------------------------------------------------------------------------

    def _start_lane(
        self,
        key: str,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | None] | None = None,
    ) -> None:
        """A lane task that begins with ``first`` (an idle lane's message or an internal
        resume) or else the queue head; ``begun`` learns how storing ``first`` went."""
        lane = self._lanes[key] = _Lane()
        lane.task = asyncio.create_task(self._run_lane(key, lane, first, begun))

    def _dispatch_next(self, key: str) -> None:
        """Start the lane's queue head if the lane is idle and the gateway dispatches."""
        if self._busy(key) or key in self._retrying or self._gate or self._stopping is not None:
            return
        head = self._queue.head(key)
        if self.shared is not None and not self.store.holds(key):
            if head is not None:
                self.shared.take(key)  # dispatched here once the lease is taken
            return
        if head is None:
            if self.shared is not None:
                self.shared.release(key)
            return
        if self._command(head.event)[0] is not None:
            self._commands[key] = asyncio.create_task(self._queued_command(key))
            return
        if self._connected(head.event.source.platform):
            self._start_lane(key, None)

    async def _run_lane(
        self,
        key: str,
        lane: _Lane,
        first: MessageEvent | None,
        begun: asyncio.Future[Turn | None] | None = None,
    ) -> None:
        """Run the lane's turns one after another until its queue has nothing dispatchable."""
        try:
            turn = await self._begin_next(key, first, begun)
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
        begun: asyncio.Future[Turn | None] | None,
    ) -> Turn | None:
        """Store the start of the lane's next turn: ``first`` (an idle lane's message, whose
        outcome ``begun`` reports to ``handle_message``, or an internal resume) or the queue
        head when it can be dispatched now; None when there is nothing to start."""
        if first is not None:
            try:
                turn = await self.store.arun(self._pipeline.begin, key, first, None)
            except Exception as exc:
                if begun is None:
                    logger.exception("a resumed turn could not start; it resumes next start")
                else:
                    begun.set_exception(exc)
                return None
            if turn is not None:
                self._begun(key, first)
            if begun is not None:
                begun.set_result(turn)
            return turn
        while (head := self._queue.head(key)) is not None:
            if self._command(head.event)[0] is not None:
                return None
            if not self._connected(head.event.source.platform):
                return None  # waits for the platform, never dropped
            if not await self._wake_current(key, head.event):
                logger.warning("dropped an internal wake bound to an earlier session")
                await self.store.arun(self._take_head, key)
                continue
            try:
                turn = await self.store.arun(self._begin_head, key)
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

    def _begin_head(self, key: str) -> Turn | None:
        """Take the queue head and store its turn's start (writer step: one commit, which
        also deletes its rows); a redelivered head is dropped. None if nothing started."""
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
            dead = await self.store.arun(self._fail_head, key, head, repr(error))
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

    async def _run_turn(self, lane: _Lane, turn: Turn) -> None:
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

    async def _agent_turn(self, lane: _Lane, turn: Turn, agent: Agent) -> None:
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
            owed = await self.store.arun(
                self._pipeline.finish, turn, None if failed else reply, success
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
        crash_point("obligation_recorded")
        await self._deliver(owed.row, turn=turn, success=success, claimed=owed.ledgered)

    async def _turn_failed(self, turn: Turn) -> None:
        await self._reply(turn.event.source, TURN_FAILED)
        await self._close(turn, success=False)

    async def _close(self, turn: Turn, *, success: bool) -> None:
        """Close a turn that owes nothing; a store failure leaves its marker (logged), so the
        turn is resumed after the next restart rather than lost."""
        try:
            close = functools.partial(self.store.close_turn, success=success)
            await self.store.arun(close, turn.key, turn.token)
        except Exception:
            logger.exception("a turn could not be closed; its marker stays set")

    def _request(self, turn: Turn) -> TurnRequest:
        """The agent's input: the session-context prompt (cached per session and source: it is
        byte-identical from turn to turn) and the message; the history loads on demand."""
        source, session_id = turn.event.source, turn.entry.session_id
        cached = self._prompts.get((session_id, source))
        if cached is None:
            context = build_session_context(source, self.config, turn.entry, plugins=self.plugins)
            prompt = build_session_context_prompt(context, plugins=self.plugins)
            cached = self._prompts[(session_id, source)] = (prompt, context)
        prompt, context = cached
        text = turn.event.text
        if context.shared_multi_user_session and not turn.event.internal:
            text = prefix_sender(text, source, context, plugins=self.plugins)
        store = self.store
        return TurnRequest(
            turn.key, session_id, prompt, turn.message(text), turn.event,
            lambda: store.load_transcript(session_id)[:-1],
        )  # fmt: skip

    # -- sending -----------------------------------------------------------------------------------

    async def _deliver(
        self,
        row: Obligation,
        *,
        prefix: str | None = None,
        turn: Turn | None = None,
        success: bool = True,
        claimed: bool = False,
        close: bool = False,
    ) -> bool:
        """The one claim → send → settle path, for turns, the boot sweep, reconnects and
        rate-limit retries. A turn's reply arrives claimed (``claimed``); settling also closes
        the turn, or with ``close`` (the boot sweep) clears the lane's resume flag. A turn does
        not wait for its settle; a sweep does (after the boot sweep the lanes are resumed: an
        answered turn must not look interrupted). True when the platform accepted the reply."""
        ident = row.obligation_id
        if ident and ident in self._sending:
            return False
        if ident:
            self._sending.add(ident)
        try:
            ledger = self.store.ledger
            if not claimed and ident and ledger is not None:
                claim = functools.partial(ledger.claim, marked=prefix is not None)
                claimed_row = await self.store.arun(claim, row)
                if claimed_row is None:  # no attempt left: abandoned
                    if turn is not None:
                        await self._close(turn, success=success)
                    return False
                row = claimed_row
            text = f"{prefix}\n\n{row.content}" if prefix else row.content
            result = await self._send(row, text, turn.event.source if turn is not None else None)
            if result.ok:
                crash_point("sent")
            settling = self._settle(row, result, turn, success, close)
            if turn is None:  # a sweep's send: settled before the sweep goes on
                await asyncio.wait([settling])
            return result.ok
        finally:
            self._sending.discard(ident)

    def _settle(
        self, row: Obligation, result: SendResult, turn: Turn | None, success: bool, close: bool
    ) -> asyncio.Future[bool]:
        """Settle a send (the turn's last commit) without holding up the lane: the step is
        handed to the writer now, so the lane's next step queues behind it and can never
        overtake it; ``idle`` and ``stop`` wait for it."""
        settling = self.store.submit(self._settle_step, row, result, turn, success, close)
        self._background.add(settling)
        settling.add_done_callback(functools.partial(self._settled, row, result))
        return settling

    def _settle_step(
        self, row: Obligation, result: SendResult, turn: Turn | None, success: bool, close: bool
    ) -> bool:
        """Writer step: settle the ledger row and close the turn; the crash points of a
        delivery pass once this is committed."""
        delivered = self._pipeline.settle(row, result, turn, success, close)
        if delivered:
            self.store.after_commit(_delivered)
        return delivered

    def _settled(self, row: Obligation, result: SendResult, settling: asyncio.Future[bool]) -> None:
        self._background.discard(settling)
        if settling.cancelled():
            return
        error = settling.exception()
        if error is not None:
            logger.error("a send could not be settled; the reply stays owed: %s", error)
        elif not settling.result() and result.failure_kind == "rate_limited":
            retry = functools.partial(self._send_due, "rate_limit", [row.platform])
            self._later(RATE_LIMIT_RETRY_SECS * max(1, row.attempts), retry)

    async def _send_due(
        self,
        occasion: Occasion,
        platforms: Sequence[str],
        lanes: Callable[[str], bool] | None = None,
    ) -> None:
        """Send the owed replies of ``platforms`` for an occasion (see ``DeliveryLedger.due``),
        of ``lanes`` only if given (on a shared store, of the lanes this process holds)."""
        ledger = self.store.ledger
        if ledger is None or not platforms:
            return
        try:
            mine = self.store.holds if self.shared is not None else None
            due = await self.store.arun(
                ledger.due, occasion, platforms, frozenset(self._sending), lanes or mine
            )
        except Exception:
            logger.exception("owed replies could not be read (%s)", occasion)
            return
        for row, prefix in due:
            await self._deliver(row, prefix=prefix, close=occasion == "boot")

    def _later(self, delay: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        """Call ``callback`` after ``delay`` seconds unless the gateway stops first; a
        coroutine it returns runs as a task of the gateway."""
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            if self._stopping is not None:
                return
            work = callback()
            if asyncio.iscoroutine(work):
                task = loop.create_task(work)
                self._background.add(task)
                task.add_done_callback(self._background.discard)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)
        return handle

    async def _reply(self, source: SessionSource, text: str) -> None:
        """A direct (unledgered) message: acknowledgements, notices, command replies; a failure
        to send one is logged, never raised."""
        adapter = self.adapters.get(source.platform)
        if adapter is None or not adapter.is_connected():
            logger.warning("no connected adapter for %s; a notice was not sent", source.platform)
            return
        try:
            await adapter.send(source, text)
        except Exception:
            logger.exception("a notice could not be sent")

    async def _send(
        self, row: Obligation, text: str, source: SessionSource | None = None
    ) -> SendResult:
        """Send a claimed reply through its platform's adapter (on the loop), to ``source``
        (the turn's) or else to the chat and thread the row names."""
        adapter = self.adapters.get(row.platform)
        if adapter is None or not adapter.is_connected():
            return SendResult(ok=False, failure_kind="disconnected", error="not connected")
        if source is None:
            source = SessionSource(platform=row.platform, chat_id=row.chat_id or "",
                                   chat_type="group", thread_id=row.thread_id)  # fmt: skip
        try:
            return await adapter.send(source, text, reply_to=row.reply_to_message_id)
        except Exception as exc:  # noqa: BLE001 - a raising adapter is a failed send
            return SendResult(ok=False, failure_kind="disconnected", error=repr(exc))

    async def idle(self) -> None:
        """Wait until no turn, queued command or settling send is running (queued events of
        connected platforms included)."""
        while self._lanes or self._commands or self._background:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
            await asyncio.gather(
                *tasks, *self._commands.values(), *self._background, return_exceptions=True
            )

    # -- stop --------------------------------------------------------------------------------------

    async def stop(self, restart: bool = False) -> bool:
        """Stop dispatching, mark running turns, drain (bounded), interrupt what is left, clean
        up agents, close the store; True when the drain finished in time and every mark was
        stored. Stopping again returns the first stop's result."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop(restart))
        return await self._stop_task

    async def _stop(self, restart: bool) -> bool:
        mode = "restart" if restart else "shutdown"
        self._stopping = mode
        if self.shared is not None:
            await self.shared.stop()
        if self._housekeeping is not None:
            await self._housekeeping.stop()
        for handle in self._timers:  # retries of dispatches and rate-limited replies
            handle.cancel()
        self._timers.clear()
        self._retrying.clear()
        marked = await self._mark_running(mode)
        crash_point("drain_marked")
        tasks: list[asyncio.Future[Any]] = [
            lane.task for lane in self._lanes.values() if lane.task is not None
        ]
        tasks += [*self._commands.values(), *self._background]  # queued commands, retries
        pending: set[asyncio.Future[Any]] = set()
        if tasks:
            await self._drain(tasks)
            pending = {task for task in tasks if not task.done()}
        if pending:
            marked = await self._mark_running(mode) and marked
            for lane in list(self._lanes.values()):
                lane.halt("drain")
            for task in self._background:  # a late re-send is swept at the next start
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            crash_point("drain_timed_out")
        await asyncio.to_thread(self.cache.close)
        return await asyncio.to_thread(self.state.stop, drained=not pending and marked)

    async def _drain(self, tasks: list[asyncio.Future[Any]]) -> None:
        """Wait until ``tasks`` are done, ``agent.restart_drain_timeout`` passes or the drain
        is cut short."""
        done = asyncio.ensure_future(asyncio.wait(tasks))
        cut = asyncio.ensure_future(self._cut_drain.wait())
        await asyncio.wait(
            (done, cut), timeout=self.config.agent.restart_drain_timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )  # fmt: skip
        done.cancel()
        cut.cancel()

    async def _mark_running(self, mode: str) -> bool:
        """Flag the lanes whose turn is still running (their marker still set when the flag is
        written) to resume after the restart; False if a flag could not be stored."""
        reason = f"{mode}_timeout"
        stored = True
        for key, lane in list(self._lanes.items()):
            if lane.task is None or lane.task.done():
                continue
            try:
                await self.store.arun(
                    functools.partial(self.store.mark_resume_pending, only_if_running=True),
                    key, reason,
                )  # fmt: skip
            except Exception:
                logger.exception("a running turn could not be flagged to resume")
                stored = False
        return stored
