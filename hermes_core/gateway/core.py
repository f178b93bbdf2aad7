"""The state every part of the :class:`~hermes_core.gateway.runtime.Gateway` shares, and the small
helpers they all use. The gateway is split by concern: ``runtime`` (start, inbound events,
stop), ``lanes`` (lane tasks and their turns), ``lane_commands`` (``/new``, ``/reset``,
``/stop``, ``/queue``) and ``delivery`` (claim, send and settle a reply); each is a class over
:class:`GatewayCore`, and ``Gateway`` combines them.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from cachetools import TTLCache

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError
from hermes_core.domain.models import MessageEvent, SessionContext, SessionEntry, SessionSource
from hermes_core.domain.recent import Recent
from hermes_core.gateway.agents import Adapter, Agent, HostCallbacks
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.housekeeping import Housekeeping
from hermes_core.gateway.leased import SharedLanes
from hermes_core.gateway.texts import (
    ACK_INTERVAL_SECS,
)
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation
from hermes_core.turns.ledger import SendResult
from hermes_core.turns.pipeline import Turn, TurnPipeline
from hermes_core.turns.queue import EnqueueResult, SeenMessages, TurnQueue
from hermes_core.turns.recovery import GatewayState

logger = logging.getLogger(__name__)

SEEN_MESSAGES = 10_000
"""How many (lane, platform message id) pairs are kept in memory in front of the store's
durable redelivery check."""
PROMPT_CACHE_SIZE = 1024
AgentFactory = Callable[[SessionEntry], Agent]


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
    """Its first message is taking the lane's lease (a shared store): no turn of it runs yet."""

    def halt(self, reason: str) -> None:
        """Stop after the current turn; cancel it if the agent is still working on it."""
        self.stop = reason
        if self.in_agent and self.task is not None:
            self.task.cancel()


class GatewayCore(abc.ABC):
    """What the gateway's parts share: configuration, plugins, adapters, the agent cache, the
    store's state, the lanes and the queue."""

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
        self._lanes: dict[str, Lane] = {}
        self._commands: dict[str, asyncio.Task[None]] = {}
        """Lanes whose queue head is a command being carried out (nothing else dispatches)."""
        self._resetting: set[str] = set()
        """Lanes a reset is moving to a new session (what arrives meanwhile is queued)."""
        self._retrying: dict[str, asyncio.TimerHandle] = {}
        """Lanes waiting to retry a queued message whose turn failed to start."""
        self._timers: set[asyncio.TimerHandle] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._settling: dict[str, asyncio.Future[bool]] = {}
        """A shared store's lanes whose last turn's settle is pending: it may release the lease."""
        self._sending: set[str] = set()
        """Ledger rows being sent right now (never sent twice at once)."""
        self._gate = True
        self._stopping: str | None = None
        self._ready = asyncio.Event()
        self._acked: TTLCache[str, bool] = TTLCache(maxsize=SEEN_MESSAGES, ttl=ACK_INTERVAL_SECS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._housekeeping: Housekeeping | None = None
        self._seen = SeenMessages(SEEN_MESSAGES)
        self._prompts: Recent[tuple[object, ...], tuple[str, SessionContext]]
        self._prompts = Recent(PROMPT_CACHE_SIZE)
        """The session-context prompts of the most recently used (session id, source field
        values...) keys."""
        self._unadapted: set[str] = set()
        """Platforms without an adapter whose events were already warned about."""
        self._stop_task: asyncio.Task[bool] | None = None
        self._cut_drain = asyncio.Event()
        """Set to end a running drain at once, as if its time had run out."""

    @property
    def store(self) -> SessionStore:
        """The open store (after ``start``)."""
        if self.state.store is None:
            raise HermesError("the gateway is not started; await gateway.start() first")
        return self.state.store

    def _restore_queue(self) -> int:
        """The ``queue_restore`` recovery step (in start's worker thread): the queue is made
        visible only once restored, so nothing enqueued meanwhile is restored twice."""
        queue = self._new_queue(self.store)
        restored = queue.restore()
        for key in queue.lanes():
            for item in queue.items(key):
                self._seen.remember_event(key, item.event)
        self.queue = queue
        return restored

    def _new_queue(self, store: SessionStore) -> TurnQueue:
        """The gateway's queue over ``store`` (a command is never merged with other items)."""
        return TurnQueue(store, self.config, notify=self._notify, is_command=self._is_command)

    def _is_command(self, event: MessageEvent) -> bool:
        return self._command(event)[0] is not None

    @property
    def _notify(self) -> Callable[[Any], None] | None:
        return self.plugins.notify if self.plugins.observing else None

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

    def _reread(self, key: str) -> None:
        """On a shared store, read the lane's durable queue again (writer step), so that the
        events other processes queued for it stand in their durable order among this
        process's own."""
        if self.shared is not None:
            self._queue.reload(key)

    def _connected(self, platform: str) -> bool:
        adapter = self.adapters.get(platform)
        return adapter is not None and adapter.is_connected()

    def _busy(self, key: str) -> bool:
        return key in self._lanes or key in self._commands or key in self._resetting

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
        connected platforms included). It only waits: cancelling it (``asyncio.wait_for``
        timing out) leaves those tasks running."""
        while self._lanes or self._commands or self._background:
            tasks: set[asyncio.Future[Any]] = {*self._commands.values(), *self._background}
            tasks.update(lane.task for lane in self._lanes.values() if lane.task is not None)
            if tasks:
                await asyncio.wait(tasks)
            else:  # a lane whose task is being created
                await asyncio.sleep(0)

    # -- implemented by the parts (declared here so that each part can call the others) ---------

    @abc.abstractmethod
    async def _accept(self, key: str, event: MessageEvent) -> None:
        """Run or queue an accepted event (``runtime``)."""

    @abc.abstractmethod
    def _begun(self, key: str, event: MessageEvent) -> None:
        """A turn's first commit is done (``runtime``)."""

    @abc.abstractmethod
    async def _enqueue(self, key: str, event: MessageEvent) -> EnqueueResult:
        """Queue an event durably (``runtime``)."""

    @abc.abstractmethod
    async def _enqueued(self, key: str, event: MessageEvent, result: EnqueueResult) -> None:
        """Answer an enqueue's refusal, raising when the event was not saved (``runtime``)."""

    @abc.abstractmethod
    def _dispatch_next(self, key: str) -> None:
        """Start the lane's next queued item, if any (``lanes``)."""

    @abc.abstractmethod
    async def _close(self, turn: Turn, *, success: bool) -> None:
        """Close a turn (``lanes``)."""

    @abc.abstractmethod
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
        """Claim, send and settle one owed reply (``delivery``)."""

    @abc.abstractmethod
    def _command(self, event: MessageEvent) -> tuple[str | None, str]:
        """The command an event carries (``lane_commands``)."""

    @abc.abstractmethod
    async def _queued_command(self, key: str) -> None:
        """Carry out a command that waited in the queue (``lane_commands``)."""
