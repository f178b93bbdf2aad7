"""The asyncio runtime (SPEC §7.2, §7.8, §7.9, §8, §10, §11): one ``Gateway`` per process.

Turns of one session key never overlap; turns of different keys run concurrently. Every store
operation runs in a worker thread. Messages that arrive while a lane is busy, during the start-up
gate or during a drain are queued durably and dispatched in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cachetools import LRUCache, TTLCache

from hermes_core.agents import Adapter, Agent, TurnRequest
from hermes_core.cache import AgentCache
from hermes_core.config import GatewayConfig
from hermes_core.context import build_session_context, build_session_context_prompt, prefix_sender
from hermes_core.crashpoints import crash_point
from hermes_core.errors import HermesError, StoreError
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
from hermes_core.ledger import SendResult
from hermes_core.models import MessageEvent, SessionContext, SessionEntry, SessionSource
from hermes_core.pipeline import Reply, Turn, TurnPipeline
from hermes_core.plugins import HermesPluginManager, create_plugin_manager
from hermes_core.queue import SeenMessages, TurnQueue
from hermes_core.recovery import GatewayState
from hermes_core.resume import resume_candidates, resume_event
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation

logger = logging.getLogger(__name__)

SEEN_MESSAGES = 10_000
"""How many (lane, platform message id) pairs are remembered to ignore redeliveries."""
RECENT_MESSAGES = 20
PROMPT_CACHE_SIZE = 1024

AgentFactory = Callable[[SessionEntry], Agent]
_T = TypeVar("_T")


class _Lane:
    """A lane with a turn task running."""

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
        self.plugins = plugins if plugins is not None else create_plugin_manager(config)
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
            callbacks={"queue_restore": self._restore_queue,
                       **({"diagnostic_muted": self.callbacks.diagnostic_muted}
                          if self.callbacks.diagnostic_muted else {})},
        )  # fmt: skip
        self.queue: TurnQueue | None = None
        self.pipeline: TurnPipeline | None = None
        self._lanes: dict[str, _Lane] = {}
        self._gate = True
        self._stopping: str | None = None
        self._acked: TTLCache[str, bool] = TTLCache(maxsize=SEEN_MESSAGES, ttl=ACK_INTERVAL_SECS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._housekeeping: Housekeeping | None = None
        self._inline_store = False
        self._seen = SeenMessages(SEEN_MESSAGES)
        self._prompts: LRUCache[tuple[str, SessionSource], tuple[str, SessionContext]] = LRUCache(
            maxsize=PROMPT_CACHE_SIZE
        )

    # -- start ---------------------------------------------------------------------------------

    @property
    def store(self) -> SessionStore:
        """The open store (after ``start``)."""
        if self.state.store is None:
            raise HermesError("the gateway is not started; await gateway.start() first")
        return self.state.store

    def _restore_queue(self) -> int:
        self.queue = TurnQueue(self.store, self.config, notify=self._notify)
        restored = self.queue.restore()
        for key in self.queue.lanes():
            for item in self.queue.items(key):
                self._seen.remember_event(key, item.event)
        return restored

    def _remember_recent(self, entries: Sequence[SessionEntry]) -> None:
        """Seed the seen messages with the recent ones of lanes a crash interrupted: the
        platform may deliver their unacknowledged messages again."""
        for entry in entries:
            for message in self.store.load_transcript(entry.session_id)[-RECENT_MESSAGES:]:
                self._seen.remember(entry.session_key, message.get("platform_message_id"))

    @property
    def _notify(self) -> Callable[[Any], None] | None:
        return self.plugins.notify if self.plugins.observing else None

    async def start(self) -> None:
        """SPEC §7.2: lock, store, recovery steps under the gate; ledger sweep; auto-resume;
        lower the gate when the resumed turns end (or the wait expires); housekeeping."""
        self._loop = asyncio.get_running_loop()
        store = await asyncio.to_thread(self.state.start)
        self._inline_store = (
            store.health()["backend"] == "sqlite"
            and self.config.storage.sqlite_synchronous == "normal"
        )
        self.pipeline = TurnPipeline(store, self.config)
        if self.queue is None:  # the queue_restore step was disabled
            self.queue = TurnQueue(store, self.config, notify=self._notify)
        ledger = store.ledger
        if ledger is not None:
            connected = [name for name, adapter in self.adapters.items() if adapter.is_connected()]
            await asyncio.to_thread(  # the sweep's sends hop back onto the loop
                ledger.boot_sweep, connected, self._send_sync, store.clear_resume_pending
            )
        await self._resume(None)
        resuming = [lane.task for lane in self._lanes.values() if lane.task is not None]
        if resuming:
            await asyncio.wait(resuming, timeout=self.config.gateway.startup_restore_timeout_secs)
        self._gate = False
        for key in self.queue.lanes():
            self._dispatch_next(key)
        self._housekeeping = Housekeeping(self.config, store, self.cache)
        self._housekeeping.start()

    async def _resume(self, platform: str | None) -> int:
        """Dispatch one internal resume event per eligible lane (SPEC §7.8)."""
        entries = await self._call(
            functools.partial(
                resume_candidates, self.store, self.config.agent.gateway_auto_continue_freshness,
                platform=platform, connected=self._connected, busy=self._lanes.__contains__,
                authorised=self.callbacks.authorised,
            )
        )  # fmt: skip
        await self._call(self._remember_recent, entries)
        for entry in entries:
            if entry.session_key not in self._lanes:
                self._start_lane(entry.session_key, resume_event(entry), None)
        return len(entries)

    async def platform_connected(self, platform: str) -> None:
        """After (re)connecting a platform: retry its failed replies, resume its lanes and
        dispatch the queue heads that waited for it."""
        ledger = self.store.ledger
        if ledger is not None:
            await asyncio.to_thread(ledger.retry_failed, platform, self._send_sync)
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

    async def handle_message(self, event: MessageEvent) -> None:
        """Run or queue the turn for an inbound event (SPEC §7.9, §8.4)."""
        key = self.store.session_key_for(event.source)
        if self._seen.seen_before(key, event):
            logger.info("ignored a message delivered again")
            return
        self._seen.remember_event(key, event)
        if self._stopping is not None:
            await self._enqueue_while_draining(key, event)
            return
        if self._gate:
            await self._call(self._queue.enqueue, key, event)  # no acknowledgement yet
            return
        if not event.internal:
            command, rest = parse_command(event.text, (*self.triggers, "/stop", "/queue"))
            if command in self.triggers:
                await self._reset(key, event, rest)
                return
            if command == "/stop":
                await self._stop_lane(key, event)
                return
            if command == "/queue":
                await self._queue_command(key, event, rest)
                return
        await self._accept(key, event)

    async def _accept(self, key: str, event: MessageEvent) -> None:
        queue = self._queue
        idle = key not in self._lanes and queue.depth(key) == 0
        if idle and self._connected(event.source.platform):
            self._start_lane(key, event, None)
            return
        result = await self._call(queue.enqueue, key, event)
        if not result.accepted:
            if not event.internal:
                await self._refusal(event, result.refused, result.depth)
            return
        lane = self._lanes.get(key)
        if lane is None:
            self._dispatch_next(key)
            return
        if event.internal or result.merged:
            return
        interrupting = False
        if self.config.display.busy_input_mode == "interrupt" and lane.agent is not None:
            interrupting = await lane.agent.interrupt()
            lane.interrupted = lane.interrupted or interrupting
        await self._ack(key, event, ACK_INTERRUPT if interrupting else ACK_QUEUED)

    async def _refusal(self, event: MessageEvent, reason: str | None, depth: int) -> None:
        text = REFUSED_CAP.format(n=depth) if reason == "cap" else REFUSED_NOT_SAVED
        await self._reply(event.source, text)

    async def _ack(self, key: str, event: MessageEvent, text: str) -> None:
        """Acceptance acknowledgements: at most one per lane per 30 s, and only if enabled."""
        if not self.config.gateway.busy_ack_enabled or key in self._acked:
            return
        self._acked[key] = True  # expires after ACK_INTERVAL_SECS
        await self._reply(event.source, text)

    async def _enqueue_while_draining(self, key: str, event: MessageEvent) -> None:
        result = await self._call(self._queue.enqueue, key, event)
        if event.internal or self._stopping is None:
            return
        texts = DRAIN_QUEUED if result.accepted else DRAIN_REFUSED
        await self._reply(event.source, texts[self._stopping])

    # -- commands ----------------------------------------------------------------------------------

    async def _halt(self, key: str, reason: str) -> bool:
        """Hard-interrupt the lane's running turn; True if one was running."""
        lane = self._lanes.get(key)
        if lane is None or lane.task is None:
            return False
        lane.halt(reason)
        await asyncio.gather(lane.task, return_exceptions=True)
        return True

    def _interrupt_background(self, key: str) -> bool:
        interrupt = self.callbacks.interrupt_background
        session_id = self.store.peek_session_id(key)
        if interrupt is None or session_id is None:
            return False
        try:
            return bool(interrupt(key, session_id))
        except Exception:
            logger.exception("interrupting background work failed")
            return False

    async def _discard(self, discard: Callable[[str], int], key: str) -> int:
        """Run a queue discard; a store failure keeps the items (logged) and counts nothing."""
        try:
            return await self._call(discard, key)
        except StoreError:
            logger.exception("queued messages could not be discarded; they stay queued")
            return 0

    async def _reset(self, key: str, event: MessageEvent, rest: str) -> None:
        """SPEC §6.2: interrupt, discard human items, clean up the agent, new session, reply."""
        await self._halt(key, "user")
        self._interrupt_background(key)
        await self._discard(self._queue.discard_humans, key)
        await asyncio.to_thread(self.cache.discard, key)  # full cleanup runs off the loop
        if await self._call(self.store.reset_session, key) is None:
            await self._call(self.store.get_or_create_session, event.source, True)
        await self._call(self._pipeline.counts.remove, key)
        await self._reply(event.source, NEW_SESSION)
        if rest.strip():
            await self._call(self._queue.enqueue, key, event.replace(text=rest))
        self._dispatch_next(key)

    async def _stop_lane(self, key: str, event: MessageEvent) -> None:
        """SPEC §8.5 ``/stop``: interrupt the turn and background work, drop the slot's human
        follow-up, keep the overflow (``/queue`` items and internal wakes), say what happened."""
        stopped = await self._halt(key, "user")
        stopped = self._interrupt_background(key) or stopped
        discarded = await self._discard(self._queue.discard_slot, key)
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
        """SPEC §8.5 ``/queue <prompt>``: one complete turn, in order, never merged."""
        if not prompt.strip() and not event.media_urls:
            await self._reply(event.source, QUEUE_USAGE)
            return
        if key not in self._lanes and self._queue.depth(key) == 0:
            await self._accept(key, event.replace(text=prompt))
            return
        item = event.replace(text=prompt, queued_via_command=True)
        result = await self._call(self._queue.enqueue, key, item)
        if not result.accepted:
            await self._refusal(event, result.refused, result.depth)
            return
        suffix = f" ({result.depth} queued)" if result.depth > 1 else ""
        await self._reply(event.source, QUEUED_COMMAND + suffix)
        if key not in self._lanes:
            self._dispatch_next(key)

    # -- lanes and turns ---------------------------------------------------------------------------

    def _start_lane(self, key: str, event: MessageEvent, event_id: int | None) -> None:
        lane = self._lanes[key] = _Lane()
        lane.task = asyncio.create_task(self._run_lane(key, lane, event, event_id))

    def _dispatch_next(self, key: str) -> None:
        """Start the lane's queue head if the lane is idle and the gateway dispatches."""
        if key in self._lanes or self._gate or self._stopping is not None:
            return
        item = self._next_item(key)
        if item is not None:
            self._start_lane(key, item[0], item[1])

    def _next_item(self, key: str) -> tuple[MessageEvent, int | None] | None:
        """The lane's next dispatchable event: its platform connected; a wake bound to an older
        session only if the host's resolver allows it (else dropped, logged)."""
        queue = self._queue
        while (head := queue.head(key)) is not None:
            if not self._connected(head.event.source.platform):
                return None  # waits for the platform, never dropped
            item = queue.pop_head(key)
            if item is None:
                return None
            bound = item.event.bound_session_id
            stale = item.event.internal and bound and bound != self.store.peek_session_id(key)
            if stale and not self._wake_allowed(item.event, str(bound)):
                logger.warning("dropped an internal wake bound to an earlier session")
                if item.event_id is not None:
                    self.store.queue_remove([item.event_id])
                continue
            return item.event, item.event_id
        return None

    def _wake_allowed(self, event: MessageEvent, session_id: str) -> bool:
        resolver = self.callbacks.wake_allowed
        if resolver is None:
            return False
        try:
            return bool(resolver(event, session_id))
        except Exception:
            logger.exception("the wake resolver failed")
            return False

    async def _run_lane(
        self, key: str, lane: _Lane, event: MessageEvent, event_id: int | None
    ) -> None:
        """Run the lane's turns one after another until its queue has nothing dispatchable."""
        try:
            while True:
                await self._run_turn(key, lane, event, event_id)
                lane.interrupted = False
                halted = lane.stop is not None or self._stopping or self._gate
                item = None if halted else self._next_item(key)
                if item is None:
                    return
                event, event_id = item
        finally:
            if self._lanes.get(key) is lane:
                del self._lanes[key]

    async def _run_turn(
        self, key: str, lane: _Lane, event: MessageEvent, event_id: int | None
    ) -> None:
        """One turn: the blocking work before the agent, after it, and after the send runs in
        one store call each (see ``_call``); the agent and the adapter run on the loop."""
        prepared = await self._call(self._prepare, key, event, event_id)
        if prepared is None:
            return
        turn, agent, request, suspended_before = prepared
        lane.agent = agent
        reply: str | None = None
        failed = False
        lane.in_agent = lane.stop is None
        try:
            if lane.stop is not None:  # halted while the turn was being prepared
                raise asyncio.CancelledError
            if suspended_before and not event.internal:
                await self._reply(event.source, SUSPENDED_NOTICE)
            reply = await agent.run_turn(request)
        except asyncio.CancelledError:
            self.cache.end_turn(key, agent)
            if lane.stop == "user":  # stopped by the user: nothing owed, nothing to resume
                await self._call(self.store.clear_turn_active, key, turn.token)
            raise  # a drain keeps the marker: the turn resumes after the restart
        except Exception:
            logger.exception("a turn failed")
            failed = True
            await self._reply(event.source, TURN_FAILED)
        finally:
            lane.in_agent = False
        success = not failed and not lane.interrupted
        owed = await self._call(self._finish, turn, None if failed else reply, success)
        result = (
            await self._send(self._pipeline.addressed(turn, owed), owed.content) if owed else None
        )
        await self._call(self._close, turn, agent, owed, result, success)

    async def _call(self, function: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking store call: inline on the loop when the store never waits for a disk
        flush or the network (SQLite with ``synchronous: normal``, where a worker-thread hop
        costs more than the call), else in a worker thread."""
        if self._inline_store and not self.store.degraded:
            return function(*args)
        return await asyncio.to_thread(function, *args)

    def _prepare(
        self, key: str, event: MessageEvent, event_id: int | None
    ) -> tuple[Turn, Agent, TurnRequest, bool] | None:
        """Start the turn durably, take the lane's agent and build its input (blocking)."""
        before = self.store.lookup_by_session_key(key)
        turn = self._pipeline.begin(event, event_id)
        if turn is None:
            return None
        agent = self.cache.get_or_create(
            key, turn.entry.session_id, lambda: self.agent_factory(turn.entry), begin_turn=True
        )
        try:
            request = self._request(turn)
        except BaseException:
            self.cache.end_turn(key, agent)
            self._pipeline.complete(turn, success=False)
            raise
        return turn, agent, request, before is not None and before.suspended

    def _finish(self, turn: Turn, reply: str | None, success: bool) -> Reply | None:
        """Store and record the reply, then claim it for sending (blocking); None if nothing is
        to be sent."""
        if not (success or reply):
            return None
        owed = self._pipeline.finish(turn, reply)
        return owed if owed is not None and self._pipeline.claim(owed) else None

    def _close(
        self, turn: Turn, agent: Agent, owed: Reply | None, result: SendResult | None,
        success: bool,
    ) -> None:  # fmt: skip
        """Settle the send, close the turn and update the cache (blocking)."""
        key = turn.entry.session_key
        try:
            if owed is not None and result is not None:
                self._pipeline.settle(turn, owed, result)
        finally:
            self.cache.end_turn(key, agent)
            # The turn's user message and reply are in the store: nothing held only in memory.
            self.cache.report_persistence(key, agent, persisted=2, in_memory=2)
            self._pipeline.complete(turn, success=success)

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
            turn.entry.session_key, session_id, prompt, turn.message(text), turn.event,
            lambda: store.load_transcript(session_id)[:-1],
        )  # fmt: skip

    # -- sending -----------------------------------------------------------------------------------

    async def _reply(self, source: SessionSource, text: str) -> None:
        """A direct (unledgered) message: acknowledgements, notices, command replies."""
        adapter = self.adapters.get(source.platform)
        if adapter is None or not adapter.is_connected():
            logger.warning("no connected adapter for %s; a notice was not sent", source.platform)
            return
        await adapter.send(source, text)

    async def _send(self, row: Obligation, text: str) -> SendResult:
        """Send a claimed reply through its platform's adapter (on the loop)."""
        adapter = self.adapters.get(row.platform)
        if adapter is None or not adapter.is_connected():
            return SendResult(ok=False, failure_kind="disconnected", error="not connected")
        source = SessionSource(platform=row.platform, chat_id=row.chat_id or "",
                               chat_type="group", thread_id=row.thread_id)  # fmt: skip
        try:
            return await adapter.send(source, text, reply_to=row.reply_to_message_id)
        except Exception as exc:  # noqa: BLE001 - a raising adapter is a failed send
            return SendResult(ok=False, failure_kind="disconnected", error=repr(exc))

    def _send_sync(self, row: Obligation, text: str) -> SendResult:
        """The ledger sweeps' send function (they run in a worker thread; the send on the loop)."""
        if self._loop is None:
            return SendResult(ok=False, failure_kind="disconnected", error="not connected")
        return asyncio.run_coroutine_threadsafe(self._send(row, text), self._loop).result()

    async def idle(self) -> None:
        """Wait until no turn is running (queued events of connected platforms included)."""
        while self._lanes:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- stop --------------------------------------------------------------------------------------

    async def stop(self, restart: bool = False) -> bool:
        """SPEC §7.8: stop dispatching, mark running lanes, drain (bounded), interrupt what is
        left, clean up agents, close the store; True when the drain finished in time."""
        mode = "restart" if restart else "shutdown"
        reason = "restart_timeout" if restart else "shutdown_timeout"
        self._stopping = mode
        if self._housekeeping is not None:
            await self._housekeeping.stop()
        running = dict(self._lanes)
        for key in running:
            await self._call(self.store.mark_resume_pending, key, reason)
        crash_point("drain_marked")
        tasks = [lane.task for lane in running.values() if lane.task is not None]
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _done, pending = await asyncio.wait(
                tasks, timeout=self.config.agent.restart_drain_timeout
            )
        if pending:
            for key, lane in list(self._lanes.items()):
                await self._call(self.store.mark_resume_pending, key, reason)
                lane.halt("drain")
            await asyncio.gather(*pending, return_exceptions=True)
            crash_point("drain_timed_out")
        await asyncio.to_thread(self.cache.close)
        return await asyncio.to_thread(self.state.stop, drained=not pending)
