"""Taking over the lanes of a gateway process that died or hung, on a store shared by several
processes (the :class:`~hermes_core.gateway.leased.LeasedOwnership` holds a :class:`Takeovers`).

A lane whose holder let its lease expire is taken over once, whether the scan finds it or a
message for it finds its lease expired: crash-left replies recorded, the interrupted turn armed
and resumed once, owed replies sent (marked where they may be duplicates), then its queued
events run. Until the takeover has started the resumed turn, nothing else is dispatched on the
lane: a queued message run first would carry the interrupted turn's resume away with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.specs import LifecycleEvent
from hermes_core.store import SessionStore
from hermes_core.turns.queue import TurnQueue
from hermes_core.turns.recovery import marker_max_age, record_crash_left_replies

logger = logging.getLogger(__name__)


class Takeovers:
    """The lanes being taken over here, the scan that finds them and the store-side recovery
    of each; the lane side of a takeover (``take_over``) is the gateway's."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        queue: TurnQueue,
        *,
        take_over: Callable[[str], Coroutine[Any, Any, None]],
        dispatch: Callable[[str], None],
        diagnostic_muted: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.queue = queue
        self._take_over = take_over
        self._dispatch = dispatch
        self._muted = diagnostic_muted
        self._recovering: set[str] = set()
        """Marked in writer steps (unmarked if their batch is rolled back), unmarked on the
        loop once the takeover has started the resumed turn."""

    def recovering(self, key: str) -> bool:
        """Whether the lane is being taken over here: nothing may be dispatched on it yet."""
        return key in self._recovering

    def mark(self, key: str) -> None:
        """Writer step: the lane is taken over here, before the writer lets anything else near
        it (unmarked if the step's batch is rolled back: the step then runs again)."""
        self._recovering.add(key)
        self.store._writer.on_rollback(lambda: self._recovering.discard(key))

    async def scan(self) -> None:
        """Every ``storage.lease_scan_secs``, look for lanes whose holder let the lease expire
        and take them over."""
        while True:
            await asyncio.sleep(self.config.storage.lease_scan_secs)
            try:
                taken = await self.store.arun(self._claim_step)
            except Exception:
                logger.exception("looking for lanes to take over failed")
                continue
            await self.recover_lanes(taken)

    def _claim_step(self) -> list[str]:
        """Writer step: the leases of the lanes to take over, each marked as recovering (one
        being taken over here already is left to that takeover; the marks are undone if the
        batch is rolled back, so the step's next run claims those lanes again)."""
        claimed = self.store._leases.claim_orphaned_lanes(expired=True)
        taken = [key for key in claimed if key not in self._recovering]
        self._recovering.update(taken)
        self.store._writer.on_rollback(lambda: self._recovering.difference_update(taken))
        return taken

    async def recover_lanes(self, keys: list[str]) -> None:
        """Take over lanes marked as recovering, concurrently; each is dispatched once its
        takeover has started its resumed turn (or found none to resume)."""
        await asyncio.gather(*(self._recover_lane(key) for key in keys))

    async def _recover_lane(self, key: str) -> None:
        try:
            await self._take_over(key)
        except Exception:
            logger.exception("taking over a lane failed; its lease is left to expire")
            await self._abandon(key)
            return
        finally:
            self._recovering.discard(key)
        plugins = self.store.plugins
        if plugins.observing:
            plugins.notify(LifecycleEvent(kind="lane_taken_over", session_key=key))
        self._dispatch(key)

    async def _abandon(self, key: str) -> None:
        try:
            await self.store.arun(self._abandon_step, key, lane=key)
        except Exception:
            logger.exception("a lane whose takeover failed could not be let go")

    def _abandon_step(self, key: str) -> None:
        """Writer step: stop renewing the lane's lease and forget its queue here; once the lease
        expires the lane is taken over again (by the next scan, here or elsewhere)."""
        self.store._leases.abandon_lease(key)
        self.queue.forget(key)

    def recover(self, key: str) -> None:
        """Writer-side recovery of one taken-over lane (in a worker thread): a reply the dead
        holder stored but never recorded is recorded, the interrupted turn is armed to resume
        once; then the lane's durable queue is loaded here."""
        store = self.store
        record_crash_left_replies(store, self.config, self._muted, lanes=[key])
        store._turns.recover_turn_markers(marker_max_age(self.config), lanes=[key])
        store.run(self.queue.reload, key, lane=key)
