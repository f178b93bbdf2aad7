"""Resuming interrupted turns: one internal resume turn per eligible lane at start and when a
platform (re)connects (see :mod:`hermes_core.turns.resume` for which lanes are eligible), and
the lane side of a takeover on a shared store (what the dead holder owed is sent, its cut turn
resumed once)."""

from __future__ import annotations

import asyncio
import functools

from hermes_core.config.schema import GatewayConfig
from hermes_core.gateway.agents import HostCallbacks
from hermes_core.gateway.delivery import Delivery, Platforms
from hermes_core.gateway.lanes import Lanes
from hermes_core.gateway.lifecycle import Background
from hermes_core.gateway.ownership import LaneOwnership
from hermes_core.store import SessionStore
from hermes_core.store.turns import AUTO_RESUME_REASONS
from hermes_core.turns.resume import resumable, resume_candidates, resume_event


class Resumer:
    """Starts the resume turns of interrupted lanes."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        lanes: Lanes,
        delivery: Delivery,
        ownership: LaneOwnership,
        platforms: Platforms,
        background: Background,
        callbacks: HostCallbacks,
    ) -> None:
        self._config = config
        self._store = store
        self._lanes = lanes
        self._delivery = delivery
        self._ownership = ownership
        self._platforms = platforms
        self._background = background
        self._callbacks = callbacks
        self._deferred: set[str] = set()
        """Lanes due a resume that were busy when it was due."""

    async def resume(self, platform: str | None) -> int:
        """Start one internal resume turn per eligible lane (of ``platform`` only if given); a
        lane busy now (a message of it being stored, a redelivery being recognised) is resumed
        when it goes idle, unless its turn answered it meanwhile (:meth:`idle`)."""
        entries = await asyncio.to_thread(
            functools.partial(
                resume_candidates, self._store, self._config.agent.gateway_auto_continue_freshness,
                platform=platform, connected=self._platforms.connected,
                authorised=self._callbacks.authorised,
            )
        )  # fmt: skip
        for entry in entries:
            if self._occupied(entry.session_key):
                self._deferred.add(entry.session_key)
            else:
                self._lanes.start(entry.session_key, resume_event(entry))
        return len(entries)

    def idle(self, key: str) -> None:
        """A lane went idle: resume it if a resume waited for it and it is still to resume
        (a turn that ran on it meanwhile answered with the resume note and cleared it)."""
        if key in self._deferred and not self._occupied(key):
            self._deferred.discard(key)
            self._background.track(asyncio.ensure_future(self._resume_lane(key)))

    async def _resume_lane(self, key: str) -> None:
        entry = await asyncio.to_thread(self._store.lookup_by_session_key, key)
        if entry is not None and resumable(
            entry, self._store, self._config.agent.gateway_auto_continue_freshness,
            connected=self._platforms.connected, busy=self._occupied,
            authorised=self._callbacks.authorised,
        ):  # fmt: skip
            self._lanes.start(key, resume_event(entry))

    async def resumed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the resumed turns have ended, their last
        commit (the settle of their reply) included."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        resuming = self._lanes.turn_tasks()
        if resuming:
            await asyncio.wait(resuming, timeout=timeout)
        settling = list(self._background.tasks)  # the settles the resumed turns left
        if settling and deadline > loop.time():
            await asyncio.wait(settling, timeout=deadline - loop.time())

    def _occupied(self, key: str) -> bool:
        """Busy here, or being taken over here (its takeover resumes it)."""
        return self._lanes.busy(key) or self._ownership.recovering(key)

    async def take_over(self, key: str) -> None:
        """A lane whose holder let its lease expire, now held here (and kept from dispatch
        meanwhile): recover it once, send what it owes (marked where it may be a duplicate),
        resume its interrupted turn once; its queue runs next (see ``takeover``)."""
        lane = self._lanes.get(key)
        if lane is not None and lane.opening and lane.task is not None:
            # A message for the lane is taking its lease: its step comes after this takeover's
            # grant, so it only queues the message and the task ends; then recover the lane.
            await asyncio.gather(lane.task, return_exceptions=True)
        if self._lanes.busy(key):  # a lane of ours whose lease was renewed late
            return
        await asyncio.to_thread(self._ownership.recover, key)
        await self._delivery.send_due("takeover", self._platforms.connected_names(), key.__eq__)
        entry = await asyncio.to_thread(self._store.lookup_by_session_key, key)
        origin = entry.origin if entry is not None else None
        if (
            entry is not None and origin is not None and entry.resume_pending
            and not entry.suspended and entry.resume_reason in AUTO_RESUME_REASONS
            and self._platforms.connected(origin.platform) and not self._lanes.busy(key)
        ):  # fmt: skip
            self._lanes.start(key, resume_event(entry))
