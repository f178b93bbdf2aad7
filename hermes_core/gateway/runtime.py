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
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from types import TracebackType
from typing import Any, NoReturn

from hermes_core.domain.errors import HermesError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent
from hermes_core.gateway.commands import LaneCommands
from hermes_core.gateway.delivery import Delivery
from hermes_core.gateway.housekeeping import Housekeeping
from hermes_core.gateway.lanes import LaneRunner
from hermes_core.gateway.leased import SharedLanes
from hermes_core.gateway.texts import (
    ACK_INTERRUPT,
    ACK_QUEUED,
    DRAIN_QUEUED,
    DRAIN_REFUSED,
    REFUSED_CAP,
    REFUSED_FULL,
    REFUSED_NOT_SAVED,
)
from hermes_core.store.turns import AUTO_RESUME_REASONS
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import Turn, TurnPipeline
from hermes_core.turns.queue import EnqueueResult
from hermes_core.turns.resume import resume_candidates, resume_event

logger = logging.getLogger(__name__)


class Gateway(LaneCommands, LaneRunner, Delivery):
    """Runs turns for inbound events: recovery at start, queueing, commands, drain at stop."""

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

    async def start(self) -> None:
        """Lock, store, recovery steps under the gate; ledger sweep; auto-resume;
        lower the gate when the resumed turns end (or the wait expires); housekeeping."""
        self._loop = asyncio.get_running_loop()
        try:
            store = await asyncio.to_thread(self.state.start)
            self.pipeline = TurnPipeline(store, self.config)
            if self.queue is None:  # the queue_restore step was disabled
                self.queue = self._new_queue(store)
        finally:
            self._ready.set()  # messages waiting for the queue go on (or fail, if start did)
        if store.shared:  # the leases start-up took are renewed while its turns resume
            self.shared = SharedLanes(
                self.config, store, self._queue, dispatch=self._dispatch_next,
                take_over=self._take_over, diagnostic_muted=self.callbacks.diagnostic_muted,
            )  # fmt: skip
            self.shared.renew()
        connected = [name for name, adapter in self.adapters.items() if adapter.is_connected()]
        await self._send_due("boot", connected)
        await self._resume(None)
        await self._resumed(self.config.gateway.startup_restore_timeout_secs)
        self._gate = False
        if self.shared is not None:
            self.shared.scan()
            self.shared.listen(self._woken)
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
                platform=platform, connected=self._connected, busy=self._occupied,
                authorised=self.callbacks.authorised,
            )
        )  # fmt: skip
        for entry in entries:
            if not self._occupied(entry.session_key):
                self._start_lane(entry.session_key, resume_event(entry))
        return len(entries)

    def _occupied(self, key: str) -> bool:
        """Busy here, or being taken over here (its takeover resumes it)."""
        return self._busy(key) or (self.shared is not None and self.shared.recovering(key))

    async def _take_over(self, key: str) -> None:
        """A lane whose holder let its lease expire, now held here (and kept from dispatch
        meanwhile): recover it once, send what it owes (marked where it may be a duplicate),
        resume its interrupted turn once; its queue runs next (see ``sharing``)."""
        shared = self.shared
        lane = self._lanes.get(key)
        if lane is not None and lane.opening and lane.task is not None:
            # A message for the lane is taking its lease: its step comes after this takeover's
            # grant, so it only queues the message and the task ends; then recover the lane.
            await asyncio.gather(lane.task, return_exceptions=True)
        if shared is None or self._busy(key):  # a lane of ours whose lease was renewed late
            return
        await asyncio.to_thread(shared.recover, key)
        connected = [name for name, adapter in self.adapters.items() if adapter.is_connected()]
        await self._send_due("takeover", connected, key.__eq__)
        entry = await asyncio.to_thread(self.store.lookup_by_session_key, key)
        origin = entry.origin if entry is not None else None
        if (
            entry is not None and origin is not None and entry.resume_pending
            and not entry.suspended and entry.resume_reason in AUTO_RESUME_REASONS
            and self._connected(origin.platform) and not self._busy(key)
        ):  # fmt: skip
            self._start_lane(key, resume_event(entry))

    async def platform_connected(self, platform: str) -> None:
        """After (re)connecting a platform: send its owed replies, resume its lanes and
        dispatch the queue heads that waited for it."""
        await self._send_due("reconnect", [platform])
        await self._resume(platform)
        for key in self._queue.lanes():
            self._dispatch_next(key)

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

    async def _accept(self, key: str, event: MessageEvent) -> None:
        idle = not self._busy(key) and self._queue.depth(key) == 0
        if idle and self._connected(event.source.platform):
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
        ``/stop`` sees the lane from the first moment). On a shared store the event may be
        queued instead (its lease is held elsewhere, or events wait in its durable queue)."""
        loop = asyncio.get_running_loop()
        begun: asyncio.Future[Turn | EnqueueResult | None] = loop.create_future()
        self._start_lane(key, event, begun)
        try:
            turn = await begun  # cancelling this caller cancels ``begun`` only: the lane goes on
        except Exception as exc:  # noqa: BLE001 - whatever the cause, the message is not stored
            await self._not_stored(event, exc)
        if isinstance(turn, EnqueueResult):
            await self._enqueued(key, event, turn)
        elif turn is None:  # the platform delivered a message the lane already has
            logger.info("ignored a message delivered again")

    def _begun(self, key: str, event: MessageEvent) -> None:
        """A turn's first commit is done."""
        self._seen.remember_event(key, event)
        crash_point("marker_written")

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
            result = await self.store.arun(self._queue.enqueue, key, event, lane=key)
        except HermesError as exc:  # the store is closed or its commit failed twice
            await self._not_stored(event, exc)
        await self._enqueued(key, event, result)
        return result

    async def _enqueued(self, key: str, event: MessageEvent, result: EnqueueResult) -> None:
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
                await self._reply(event.source, text)
            return
        if result.refused is not None:
            await self._not_stored(event, None)
        self._seen.remember_event(key, event)
        crash_point("enqueued")

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
            await self.shared.quiesce()
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
        cut = {key for key, lane in self._lanes.items() if lane.task in pending}
        if pending:
            marked = await self._mark_running(mode) and marked
            for lane in list(self._lanes.values()):
                lane.halt("drain")
            for task in self._background:  # a late re-send is swept at the next start
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            crash_point("drain_timed_out")
        if self.shared is not None:  # the other processes run what waits on these lanes now
            await self.shared.close(keep=cut)
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
                    key, reason, lane=key,
                )  # fmt: skip
            except Exception:
                logger.exception("a running turn could not be flagged to resume")
                stored = False
        return stored
