"""The lane ownership of a store shared by several gateway processes (``storage.instances:
shared``; ``SessionStore.shared``): :class:`LeasedOwnership`, chosen at start instead of
:class:`~hermes_core.gateway.ownership.LocalOwnership`.

A lane's turns run only in the process holding the lane's lease. A message for a lane idle here
takes the lease and, when nothing waits in the lane's durable queue, begins its turn in the
same commit; otherwise (and for a lane busy here) the event is queued durably. A lane's queue
is dispatched only by the lease holder, which reloads the lane's durable queue when it takes
the lease (so events other processes queued run here, in order) and, when the lane
runs dry, releases it unless events wait. A message for a lane leased elsewhere is only
queued: the holder sees it before it can release. Two tasks run beside the lanes: one renews
the held leases every quarter of ``storage.turn_lease_secs`` (from the moment the store is
open: start-up recovery and resumed turns run under leases too), on a thread and a database
connection of its own, so a busy writer never delays it; one looks every
``storage.lease_scan_secs`` for lanes whose holder let the lease expire (it died or hung).

Such a lane is taken over once (:mod:`hermes_core.gateway.takeover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import MessageEvent
from hermes_core.gateway.lifecycle import Phase
from hermes_core.gateway.ownership import Begin, Kept
from hermes_core.gateway.takeover import Takeovers
from hermes_core.store import SessionStore
from hermes_core.store.backend import LOCKED, LeaseGrant, Locked
from hermes_core.turns.pipeline import Turn
from hermes_core.turns.queue import EnqueueResult, QueuedItem, TurnQueue

logger = logging.getLogger(__name__)

LOCKED_FIRST_RETRY_SECS = 0.005
LOCKED_RETRY_SECS = 0.25
"""Wait before a grant or release that found the lane's lease row locked by another
transaction is tried again (nothing waits for the lock meanwhile: see ``LOCKED``): the first
retry comes after :data:`LOCKED_FIRST_RETRY_SECS`, each further one after twice the last, up to
this. A row is mostly locked by the holder's release or settle, whose commit is milliseconds
away, so a hand-off waits about that long; a row held longer (a frozen transaction) costs a
retry every quarter second."""


class LeasedOwnership:
    """Lease renewal, hand-off and takeover for one gateway: a lane runs here while this
    process holds its lease. The lanes, the takeover of a lane and a command woken for it are
    the gateway's: the callables it is built with."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        queue: TurnQueue,
        phase: Phase,
        *,
        dispatch: Callable[[str], None],
        take_over: Callable[[str], Coroutine[Any, Any, None]],
        running: Callable[[str], bool],
        woken: Callable[[str], None],
        diagnostic_muted: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.queue = queue
        self._phase = phase
        self._dispatch = dispatch
        self._running = running
        self._command_woken = woken
        self._takeovers = Takeovers(
            config, store, queue, take_over=take_over, dispatch=dispatch,
            diagnostic_muted=diagnostic_muted,
        )  # fmt: skip
        self._busy: set[str] = set()
        self._locked: dict[str, int] = {}  # retries in a row of a lane whose row was locked
        self._settling: dict[str, asyncio.Future[bool]] = {}
        """Lanes whose last turn's settle is pending: it may release the lease."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewal: asyncio.Task[None] | None = None
        self._unlisten: Callable[[], None] | None = None

    @property
    def held(self) -> Callable[[str], bool] | None:
        """Only the lanes whose lease this process holds (start-up's sweep too)."""
        return self.store._leases.holds

    def start(self) -> None:
        """Start renewing the held leases (as soon as the store is open, until :meth:`close`):
        the leases start-up took are renewed while its turns resume."""
        self._renewal = asyncio.create_task(self._renew_loop())

    def run(self) -> None:
        """Start looking for lanes to take over, and listen for the lanes other processes
        wake, where the backend offers wake-ups (once the gateway dispatches)."""
        self._spawn(self._takeovers.scan())
        loop = asyncio.get_running_loop()

        def report(key: str) -> None:  # the backend's listening thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is interested
                loop.call_soon_threadsafe(self._woken, key)

        self._unlisten = self.store._leases.listen_lanes(report)

    def holds(self, key: str) -> bool:
        """Whether this process holds the lane's lease."""
        return self.store._leases.holds(key)

    def recovering(self, key: str) -> bool:
        """Whether the lane is being taken over here: nothing may be dispatched on it yet."""
        return self._takeovers.recovering(key)

    def claim(self, key: str, waiting: bool) -> bool:
        """A lane being taken over is dispatched by its takeover once its resumed turn has
        started; one held elsewhere with events waiting is taken (dispatched here once the
        lease is); one held here that ran dry gives its lease up (unless a pending settle
        does, or dispatches it again)."""
        if self._takeovers.recovering(key):
            return False
        if not self.store._leases.holds(key):
            if waiting:
                self.take(key)
            return False
        if not waiting and key not in self._settling:
            self.release(key)
        return True

    def reread(self, key: str) -> None:
        """Writer step: the lane's durable queue read again, so that the events other
        processes queued for it stand in their durable order among this process's own."""
        self.queue.reload(key)

    def pop_head(self, key: str, startable: Callable[[MessageEvent], bool]) -> QueuedItem | None:
        """Writer step: the head of the lane's durable queue, read again first (events other
        processes queued since run in their durable order among this process's own); one that
        is then not ``startable`` (a command, or waiting for its platform) is left to the
        lane's dispatch."""
        self.queue.reload(key)
        head = self.queue.head(key)
        if head is None or not startable(head.event):
            return None
        return self.queue.pop_head(key)

    def release_in_settle(self, key: str) -> Kept | None:
        """Writer step: a lane with nothing queued here gives its lease up in the settle's
        statement, unless events wait in its durable queue (then it is kept and those events
        are loaded here to run next); a lane being taken over is kept."""
        if self._takeovers.recovering(key) or self.queue.depth(key) != 0:
            return None
        return functools.partial(self.queue.reload, key)

    def settle_pending(self, key: str, settle: asyncio.Future[bool]) -> None:
        """Until the settle is done, a lane that runs dry leaves its lease alone; once it is,
        the lane is dispatched again (kept with events to run, or still held)."""
        self._settling[key] = settle
        settle.add_done_callback(functools.partial(self._settled, key))

    def _settled(self, key: str, settle: asyncio.Future[bool]) -> None:
        if self._settling.get(key) is settle:
            del self._settling[key]
            self._dispatch(key)

    async def wake(self, key: str) -> None:
        """Wake the lane's holder, which may be running a turn of it."""
        try:
            await self.store.arun(self.store._leases.wake_lane, key, lane=key)
        except Exception:  # noqa: BLE001 - the holder still runs it after its turn
            logger.warning("could not wake the holder of a lane for a command")

    def _woken(self, key: str) -> None:
        """Another process queued a command for the lane: carried out now if a turn of the lane
        runs here under this process's lease (``/stop`` interrupts the turn, as if it had
        arrived here). Or another process gave up the lane's lease with events queued (a clean
        stop): take the lane, to run them (refused if held elsewhere: its holder runs them)."""
        if self._takeovers.recovering(key):
            return
        if not self.store._leases.holds(key):
            if not self._running(key) and self._phase.dispatching:
                self.take(key)
            return
        self._command_woken(key)

    async def stop(self) -> None:
        """Stop everything, renewal included (leases left held expire or are taken back by
        this instance's next start)."""
        await self.quiesce()
        await self._stop_renewal()

    async def quiesce(self) -> None:
        """Stop the scan, the wake-ups and pending hand-offs (a stop begins); the held leases
        are still renewed while the lanes drain."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            await asyncio.to_thread(unlisten)

    async def _stop_renewal(self) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.cancel()
            await asyncio.gather(renewal, return_exceptions=True)

    async def close(self, keep: Collection[str]) -> None:
        """After the drain: stop renewing and give up every held lease but those of ``keep``
        (lanes whose turn was cut short: they are taken back by this instance's next start, or
        taken over once they expire), waking the other processes for the lanes with events
        queued, so those run elsewhere at once instead of after the lease expires."""
        await self._stop_renewal()
        try:
            given = await self.store.arun(self.store._leases.give_up_leases, keep)
        except Exception:
            logger.exception("the held turn leases could not be given up; they expire")
            return
        if given:
            logger.info("gave up the turn leases of %d lanes with messages waiting", len(given))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- hand-off ------------------------------------------------------------------------------

    def take(self, key: str) -> None:
        """Try to take the lane's lease (its queue waits here); on success dispatch its head."""
        if key not in self._busy and not self._takeovers.recovering(key):
            self._busy.add(key)
            self._spawn(self._take(key))

    async def _take(self, key: str) -> None:
        try:
            grant = await self.store.arun(self._take_step, key, lane=key)
        except Exception:
            logger.exception("a lane's lease could not be taken; the scan tries again")
            grant = None
        finally:
            self._busy.discard(key)
        if grant == LOCKED:
            self._later(key, self.take)
            return
        self._locked.pop(key, None)
        if grant == "unreleased":  # its holder died or hung: take it over, as the scan would
            await self._takeovers.recover_lanes([key])
        elif grant is not None:
            self._dispatch(key)

    def _later(self, key: str, action: Callable[[str], None]) -> None:
        """Call ``action(key)`` after the next wait of :data:`LOCKED_RETRY_SECS`'s backoff
        (unless the gateway stops)."""
        tries = self._locked.get(key, 0)
        self._locked[key] = tries + 1
        delay = min(LOCKED_RETRY_SECS, LOCKED_FIRST_RETRY_SECS * 2 ** min(tries, 16))

        async def later() -> None:
            await asyncio.sleep(delay)
            action(key)

        self._spawn(later())

    def _take_step(self, key: str) -> LeaseGrant | Locked | None:
        """Writer step: the lease and the lane's durable queue, or (held elsewhere, or being
        taken over here since the scan claimed it) nothing, or :data:`LOCKED` (try again). A
        lane it marks as recovering is unmarked if its batch is rolled back (the step then runs
        again)."""
        if self._takeovers.recovering(key):
            return None
        grant = self.store._leases.take_lease(key)
        if grant is None or grant == LOCKED:
            self.queue.forget(key)
            return grant
        self.queue.reload(key)
        if grant == "unreleased":
            self._takeovers.mark(key)
        return grant

    async def open(
        self, key: str, event: MessageEvent, begin: Begin
    ) -> Turn | EnqueueResult | None:
        """Store a message for a lane idle here, from the lane task just registered for it:
        its turn begun with ``begin`` (None: a redelivery), or the event queued instead (see
        :meth:`_open_step`). A lane whose lease was never released is taken over once that
        lane task has returned (a takeover leaves a running lane alone)."""
        opened, then = await self.store.arun(self._open_step, key, event, begin, lane=key)
        if then == "unreleased":  # the task's first step comes after the caller's lane task returns
            self._spawn(self._takeovers.recover_lanes([key]))
        elif then == LOCKED:
            self._later(key, self.take)
        else:
            self._locked.pop(key, None)
        return opened

    def _open_step(
        self, key: str, event: MessageEvent, begin: Begin
    ) -> tuple[Turn | EnqueueResult | None, LeaseGrant | Locked | None]:
        """Writer step, one transaction: take the lane's lease and, when nothing waits in its
        durable queue, begin the turn (its one commit stores the message: no queue row is
        written or deleted). Otherwise queue the event: only that when the lease is held
        elsewhere (the failed grant keeps it from changing hands until this commit, so its
        holder's release sees the event) or its row is locked (then :data:`LOCKED`: the caller
        tries the lease again shortly, as nothing marked it); with the lease taken, the lane's
        durable queue is reloaded to run here in order (``unreleased``: after a takeover, the
        lease was never released). A lane held or being taken over here already just gets the
        event queued."""
        store = self.store
        if self._takeovers.recovering(key) or store._leases.holds(key):
            return self.queue.enqueue(key, event), None
        with store._backing.transaction():
            taken = store._leases.take_idle_lease(key)
            if taken == ("free", False):
                return begin(key, event), None
            queued = self.queue.enqueue(key, event)
            if taken is None or taken == LOCKED:
                self.queue.forget(key)
                return queued, taken
            self.queue.reload(key)
            if taken[0] == "unreleased":
                self._takeovers.mark(key)
            return queued, taken[0]

    def release(self, key: str) -> None:
        """The lane ran dry here: give its lease up, or run what waits in its queue."""
        if key not in self._busy:
            self._busy.add(key)
            self._spawn(self._release(key))

    async def _release(self, key: str) -> None:
        try:
            kept = await self.store.arun(self._release_step, key, lane=key)
        except Exception:
            logger.exception("a lane's lease could not be released; it expires")
            kept = False
        finally:
            self._busy.discard(key)
        if kept == LOCKED:
            self._later(key, self._dispatch)  # the lane may have something to run by then
            return
        self._locked.pop(key, None)
        if kept:
            self._dispatch(key)

    def _release_step(self, key: str) -> bool | Locked:
        """Writer step: release (True: kept, because events wait; they are loaded here;
        :data:`LOCKED`: kept, try again)."""
        waiting = self.store._leases.release_lease(key)
        if waiting is None:
            self.queue.forget(key)
            return False
        if waiting == LOCKED:
            return waiting
        self.queue.reload(key, waiting)
        return True

    # -- renewal -------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        """Every quarter of the lease, renew the held leases on a thread of their own (not the
        writer's: a renewal queued behind the lanes' steps came too late under load; not the
        default executor's, which blocking calls into the writer may fill)."""
        interval = self.config.storage.turn_lease_secs / 4
        loop = asyncio.get_running_loop()
        renewer = ThreadPoolExecutor(1, thread_name_prefix="hermes-lease-renewal")
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    lost = await loop.run_in_executor(renewer, self.store._leases.renew_leases)
                except Exception:
                    logger.exception("turn leases could not be renewed")
                    continue
                if lost:
                    logger.warning("lost the turn lease of %d lanes to another gateway", len(lost))
        finally:
            renewer.shutdown(wait=False)

    def recover(self, key: str) -> None:
        """The store-side recovery of a lane taken over here (see :meth:`Takeovers.recover`)."""
        self._takeovers.recover(key)
