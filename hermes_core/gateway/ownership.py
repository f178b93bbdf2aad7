"""Where a lane's turns run: the lane ownership a gateway is built with, chosen once at start.

On a store of its own (the default) every lane is this process's: :class:`LocalOwnership`. On
a store shared with other gateway processes (``storage.instances: shared``) a lane's turns run
only in the process that holds the lane's lease:
:class:`~hermes_core.gateway.leased.LeasedOwnership`. The lanes, the commands and the delivery
ask the ownership the questions below and never test the mode themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from hermes_core.domain.models import MessageEvent
from hermes_core.store import SessionStore
from hermes_core.store.queue_rows import QueuedEvent
from hermes_core.turns.pipeline import Turn
from hermes_core.turns.queue import EnqueueResult, QueuedItem, TurnQueue

Begin = Callable[[str, MessageEvent], Turn | None]
"""A turn's first step (``TurnPipeline.begin``), for :meth:`LaneOwnership.open`."""
Kept = Callable[[list[QueuedEvent]], object]
"""What a settle that keeps the lane's lease hands the events waiting for it (see
``TurnPipeline.settle``)."""


class LaneOwnership(Protocol):
    """The questions the turn path asks about a lane: does it run here, and what taking,
    keeping or giving it up costs. Methods marked *writer step* run on the store's writer
    thread, inside the step that calls them."""

    @property
    def held(self) -> Callable[[str], bool] | None:
        """The lanes whose owed replies this process sends (None: every lane)."""

    def start(self) -> None:
        """The store is open: what the ownership keeps up while the lanes run starts."""

    def run(self) -> None:
        """The gateway dispatches from now on (its start-up gate is down)."""

    async def quiesce(self) -> None:
        """A stop begins: nothing new is taken on; the lanes still run and drain."""

    async def close(self, keep: Collection[str]) -> None:
        """After the drain: let go of every lane but those of ``keep`` (cut short)."""

    def holds(self, key: str) -> bool:
        """Whether the lane's turns may run in this process."""

    def recovering(self, key: str) -> bool:
        """Whether the lane is being taken over here: nothing may be dispatched on it yet."""

    def claim(self, key: str, waiting: bool) -> bool:
        """Whether the lane (``waiting``: something is queued for it) is dispatched here now;
        if not, what it needs is set going, and the lane is dispatched again once it is done."""

    def open(
        self, key: str, event: MessageEvent, begin: Begin
    ) -> Awaitable[Turn | EnqueueResult | None]:
        """Store a message for a lane idle here: its turn begun with ``begin`` (None: a
        redelivery), or the event queued instead, to run wherever the lane runs."""

    def reread(self, key: str) -> None:
        """Writer step: read the lane's durable queue again where others add to it."""

    def pop_head(self, key: str, startable: Callable[[MessageEvent], bool]) -> QueuedItem | None:
        """Writer step: take the lane's queue head out to begin its turn (None: nothing to
        begin here; ``startable`` says whether a head that was read again may start now)."""

    def release_in_settle(self, key: str) -> Kept | None:
        """Writer step, in the settle of a turn's reply: the ``kept`` that lets the settle give
        the lane up in its own statement (None: the settle keeps the lane)."""

    def settle_pending(self, key: str, settle: asyncio.Future[bool]) -> None:
        """A turn's settle was handed to the writer and may let go of the lane."""

    async def wake(self, key: str) -> None:
        """A command was queued for a lane that runs elsewhere: tell whoever runs it."""

    def recover(self, key: str) -> None:
        """Worker thread: the store-side recovery of a lane taken over from another process."""


class LocalOwnership:
    """Every lane is this process's: nothing to take, keep, give up or take over."""

    def __init__(self, store: SessionStore, queue: TurnQueue) -> None:
        self._store = store
        self._queue = queue

    @property
    def held(self) -> Callable[[str], bool] | None:
        """Every lane's replies are this process's to send."""
        return None

    def start(self) -> None:
        """Nothing to keep up."""

    def run(self) -> None:
        """Nothing to look for."""

    async def quiesce(self) -> None:
        """Nothing to stop."""

    async def close(self, keep: Collection[str]) -> None:
        """Nothing to let go of."""

    def holds(self, key: str) -> bool:
        """Every lane runs here."""
        return True

    def recovering(self, key: str) -> bool:
        """No lane is taken over from another process."""
        return False

    def claim(self, key: str, waiting: bool) -> bool:
        """Every lane is dispatched here."""
        return True

    def open(
        self, key: str, event: MessageEvent, begin: Begin
    ) -> Awaitable[Turn | EnqueueResult | None]:
        """The turn begun in one writer step (the step's future: no coroutine around it)."""
        return self._store.submit(begin, key, event, lane=key)

    def reread(self, key: str) -> None:
        """The queue in memory is the lane's whole queue."""

    def pop_head(self, key: str, startable: Callable[[MessageEvent], bool]) -> QueuedItem | None:
        """The head the lane checked before handing the step over: nobody else changes it."""
        return self._queue.pop_head(key)

    def release_in_settle(self, key: str) -> Kept | None:
        """The lane is kept."""
        return None

    def settle_pending(self, key: str, settle: asyncio.Future[bool]) -> None:
        """A settle changes nothing about where the lane runs."""

    async def wake(self, key: str) -> None:
        """No lane runs elsewhere."""

    def recover(self, key: str) -> None:
        """No lane is taken over from another process."""
