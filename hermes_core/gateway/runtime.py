"""The asyncio runtime: one ``Gateway`` per process.

Turns of one session key never overlap; turns of different keys run concurrently. Every store
write runs on the store's writer thread (``store.arun``), where concurrent lanes' steps share a
commit, so the event loop never waits on a lock, the disk or the network; reads that may touch
the disk run in worker threads. Messages that arrive while a lane is busy, during the start-up
gate or during a drain are queued durably and dispatched in order.

The acknowledgement contract: :meth:`Gateway.handle_message` returns once the event is durably
stored (the turn's first commit for an idle lane, the queue commit otherwise); an adapter may
then acknowledge the platform's message. When it cannot be stored, the sender is told and
:class:`~hermes_core.domain.errors.MessageNotStoredError` is raised, so the adapter leaves the
message unacknowledged for the platform to deliver again. Every later stage of a turn is guarded: a
failure sends the "something went wrong" notice, keeps the stored state consistent, is logged once
and never stops the lane.

``Gateway`` is a facade. At start, once the store is open, it builds its parts, each given what
it needs: the lane ownership (local, or leased on a shared store), the delivery, the turn runner,
the lanes, the admission of accepted events, the commands, the resumer and the inbound part; its
public methods delegate to them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent, SessionEntry
from hermes_core.gateway.agents import Adapter, Agent, HostCallbacks
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.commands import CommandReader, Commands
from hermes_core.gateway.delivery import Delivery, Platforms
from hermes_core.gateway.housekeeping import Housekeeping
from hermes_core.gateway.inbound import SEEN_MESSAGES, Admission, Inbound
from hermes_core.gateway.lanes import Lanes
from hermes_core.gateway.leased import LeasedOwnership
from hermes_core.gateway.lifecycle import Background, Phase
from hermes_core.gateway.ownership import LaneOwnership, LocalOwnership
from hermes_core.gateway.resuming import Resumer
from hermes_core.gateway.runner import TurnRunner
from hermes_core.gateway.streams import Streams
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import TurnPipeline
from hermes_core.turns.queue import SeenMessages, TurnQueue
from hermes_core.turns.recovery import GatewayState

logger = logging.getLogger(__name__)

AgentFactory = Callable[[SessionEntry], Agent]
NOT_STARTED = "the gateway is not started; await gateway.start() first"
START_FAILED = (
    "the gateway did not start (start() raised), so this message was not stored: leave it "
    "unacknowledged, fix what start() reported and start the gateway again"
)


@dataclass(frozen=True)
class GatewayParts:
    """What a start builds over the open store."""

    queue: TurnQueue
    ownership: LaneOwnership
    delivery: Delivery
    runner: TurnRunner
    lanes: Lanes
    inbound: Inbound
    resumer: Resumer


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
        self._reader = CommandReader(config)
        self._seen = SeenMessages(SEEN_MESSAGES)
        """The redelivery check in memory; the queue restore fills it before the parts exist."""
        self._platforms = Platforms(self.adapters)
        self._phase = Phase()
        self._background = Background(self._phase)
        self._parts: GatewayParts | None = None
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._housekeeping: Housekeeping | None = None
        self._unadapted: set[str] = set()
        """Platforms without an adapter whose events were already warned about."""
        self._stop_task: asyncio.Task[bool] | None = None
        self._cut_drain = asyncio.Event()
        """Set to end a running drain at once, as if its time had run out."""

    @property
    def store(self) -> SessionStore:
        """The open store (after ``start``)."""
        if self.state.store is None:
            raise HermesError(NOT_STARTED)
        return self.state.store

    def _started(self) -> GatewayParts:
        if self._parts is None:
            raise HermesError(NOT_STARTED)
        return self._parts

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
        notify = self.plugins.notify if self.plugins.observing else None
        return TurnQueue(store, self.config, notify=notify, is_command=self._reader.is_command)

    def _compose(
        self, store: SessionStore, queue: TurnQueue, pipeline: TurnPipeline, streams: Streams
    ) -> GatewayParts:
        """The parts over the open store. The lane ownership is chosen here, once: leased on a
        store shared with other gateway processes, else local. The ownership and the lanes
        call parts built after them (a lane taken here is dispatched, one taken over resumed,
        a command woken or at a lane's head carried out): through the functions below."""
        config, phase, background, seen = self.config, self._phase, self._background, self._seen
        platforms, reader, callbacks = self._platforms, self._reader, self.callbacks
        lanes: Lanes
        commands: Commands
        resumer: Resumer

        def dispatch(key: str) -> None:
            lanes.dispatch_next(key)

        def running(key: str) -> bool:
            return lanes.get(key) is not None

        def take_over(key: str) -> Coroutine[Any, Any, None]:
            return resumer.take_over(key)

        def woken(key: str) -> None:
            commands.woken(key)

        def queued_command(key: str) -> Coroutine[Any, Any, None]:
            return commands.queued(key)

        def idle(key: str) -> None:
            resumer.idle(key)

        ownership: LaneOwnership
        if store.shared:
            ownership = LeasedOwnership(
                config, store, queue, phase, dispatch=dispatch, take_over=take_over,
                running=running, woken=woken, diagnostic_muted=callbacks.diagnostic_muted,
            )  # fmt: skip
        else:
            ownership = LocalOwnership(store, queue)
        delivery = Delivery(store, pipeline, platforms, ownership, background, streams.commit)
        runner = TurnRunner(
            config, self.plugins, store, pipeline, self.cache, self.agent_factory, delivery,
            platforms, streams,
        )  # fmt: skip
        lanes = Lanes(
            config, store, queue, pipeline, ownership, platforms, phase, background, seen,
            callbacks, is_command=reader.is_command, run_turn=runner.run,
            queued_command=queued_command, idle=idle,
        )  # fmt: skip
        admission = Admission(config, store, queue, lanes, platforms, phase, seen)
        commands = Commands(
            store, queue, ownership, lanes, admission, reader, seen, self.cache, platforms,
            callbacks,
        )  # fmt: skip
        resumer = Resumer(
            config, store, lanes, delivery, ownership, platforms, background, callbacks
        )
        inbound = Inbound(
            store, seen, phase, admission, is_command=reader.is_command, run_command=commands.run
        )
        return GatewayParts(queue, ownership, delivery, runner, lanes, inbound, resumer)

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

    async def serve(
        self, *, before_stop: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> bool:
        """Run until SIGINT or SIGTERM (Unix), then stop with a drain; returns what ``stop``
        returns. Starts the gateway unless it is started already. ``before_stop`` is awaited
        after the first signal, before the drain (a server stops taking events there). A second
        signal during the drain interrupts the turns still running at once (they resume after
        the next start)."""
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
            if before_stop is not None:
                try:
                    await before_stop()
                except Exception:  # the drain still runs: the turns' replies are owed
                    logger.exception("stopping before the drain failed; draining anyway")
            return await self.stop()
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    async def start(self) -> None:
        """Lock, store, recovery steps under the gate; the parts; ledger sweep; auto-resume;
        lower the gate when the resumed turns end (or the wait expires); housekeeping."""
        self._loop = asyncio.get_running_loop()
        try:
            store = await asyncio.to_thread(self.state.start)
            streams = Streams(self.config, store, self.adapters)
            self.pipeline = TurnPipeline(store, self.config, streams.streams_to)
            if self.queue is None:  # the queue_restore step was disabled
                self.queue = self._new_queue(store)
            parts = self._parts = self._compose(store, self.queue, self.pipeline, streams)
        finally:
            self._ready.set()  # messages waiting for the parts go on (or fail, if start did)
        parts.ownership.start()
        await parts.delivery.send_due("boot", self._platforms.connected_names())
        await parts.resumer.resume(None)
        await parts.resumer.resumed(self.config.gateway.startup_restore_timeout_secs)
        self._phase.gate = False
        parts.ownership.run()
        for key in parts.queue.lanes():
            parts.lanes.dispatch_next(key)
        for key in store._leases.held_lanes():  # recovered lanes with nothing left to run go back
            parts.lanes.dispatch_next(key)
        self._housekeeping = Housekeeping(self.config, store, self.cache)
        self._housekeeping.start()

    async def platform_connected(self, platform: str) -> None:
        """After (re)connecting a platform: send its owed replies, resume its lanes and
        dispatch the queue heads that waited for it."""
        parts = self._started()
        await parts.delivery.send_due("reconnect", [platform])
        await parts.resumer.resume(platform)
        for key in parts.queue.lanes():
            parts.lanes.dispatch_next(key)

    async def handle_message(self, event: MessageEvent) -> None:
        """Store an inbound event durably, then run or queue its turn.

        Returns once the event is stored: the adapter may acknowledge it then. A message the
        lane already has (the platform delivering it again) is ignored. Raises
        :class:`MessageNotStoredError` when it could not be stored (the sender was told):
        leave it unacknowledged so that the platform delivers it again.
        """
        if not self._ready.is_set():
            if self._loop is None:
                raise HermesError(NOT_STARTED)
            await self._ready.wait()  # start-up has not restored the queue yet
        if self._parts is None:
            raise MessageNotStoredError(START_FAILED)
        platform = event.source.platform
        if platform not in self.adapters and platform not in self._unadapted:
            self._unadapted.add(platform)
            logger.warning(
                "no adapter for platform %r: its messages are stored and queued but not answered "
                "until the gateway is built with an adapter for it", platform,
            )  # fmt: skip
        await self._started().inbound.handle(event)

    async def idle(self) -> None:
        """Wait until no turn, queued command or settling send is running (queued events of
        connected platforms included). It only waits: cancelling it (``asyncio.wait_for``
        timing out) leaves those tasks running."""
        if self._parts is None:
            return
        lanes, background = self._parts.lanes, self._background
        while lanes.occupied() or background.tasks:
            tasks: set[asyncio.Future[Any]] = {*lanes.command_tasks(), *background.tasks}
            tasks.update(lanes.turn_tasks())
            if tasks:
                await asyncio.wait(tasks)
            else:  # a lane whose task is being created
                await asyncio.sleep(0)

    async def stop(self, restart: bool = False) -> bool:
        """Stop dispatching, mark running turns, drain (bounded), interrupt what is left, clean
        up agents, close the store; True when the drain finished in time and every mark was
        stored. Stopping again returns the first stop's result."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop(restart))
        return await self._stop_task

    async def _stop(self, restart: bool) -> bool:
        mode = "restart" if restart else "shutdown"
        self._phase.stopping = mode
        parts = self._parts
        if parts is not None:
            await parts.ownership.quiesce()
        if self._housekeeping is not None:
            await self._housekeeping.stop()
        self._background.cancel_timers()  # retries of dispatches and rate-limited replies
        if parts is None:  # never started (or its start failed): no lane ran
            crash_point("drain_marked")
            drained = True
        else:
            drained = await self._drain_lanes(parts, mode)
        await asyncio.to_thread(self.cache.close)
        return await asyncio.to_thread(self.state.stop, drained=drained)

    async def _drain_lanes(self, parts: GatewayParts, mode: str) -> bool:
        """Mark the running turns, wait for them (bounded), interrupt what is left and let the
        ownership go of the lanes; True when the drain finished in time and every mark was
        stored."""
        lanes, background = parts.lanes, self._background
        lanes.stop_retrying()
        marked = await lanes.mark_running(mode)
        crash_point("drain_marked")
        tasks: list[asyncio.Future[Any]] = [*lanes.turn_tasks(), *lanes.command_tasks()]
        tasks += background.tasks  # queued commands, retries
        pending: set[asyncio.Future[Any]] = set()
        if tasks:
            await self._drain(tasks)
            pending = {task for task in tasks if not task.done()}
        cut = lanes.keys_of(pending)
        if pending:
            marked = await lanes.mark_running(mode) and marked
            lanes.halt_all("drain")
            for task in background.tasks:  # a late re-send is swept at the next start
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            crash_point("drain_timed_out")
        await parts.ownership.close(keep=cut)  # others run what waits on the lanes let go
        return not pending and marked

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
