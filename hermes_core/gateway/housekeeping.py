"""Background housekeeping: releases idle and memory-heavy agents, prunes stale routing
entries, keeps the ledger tidy, forgets platform message ids past the redelivery window, repairs
the search index, retries SQL while degraded and rewrites ``sessions.json``. It never ends a
transcript or a session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.gateway.cache import AgentCache
from hermes_core.store import SessionStore

logger = logging.getLogger(__name__)

FTS_REBUILD_INTERVAL_SECS = 300.0


class Housekeeping:
    """The periodic pass; each task is isolated (an exception is logged, the others run)."""

    def __init__(
        self,
        config: GatewayConfig,
        store: SessionStore,
        cache: AgentCache[Any],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.cache = cache
        self._clock = clock
        self._last_prune: float | None = None
        self._last_rebuild: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._running: asyncio.Future[dict[str, object]] | None = None

    def start(self) -> None:
        """Run the pass after ``initial_delay_secs``, then every ``interval_secs``."""
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop the schedule; a pass already running (in its worker thread) is waited for, so
        that it never meets a store that the gateway has closed."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._running is not None:
            await asyncio.wrap_future(self._running)

    async def _loop(self) -> None:
        settings = self.config.gateway.housekeeping
        await asyncio.sleep(settings.initial_delay_secs)
        loop = asyncio.get_running_loop()
        while True:
            self._running = loop.run_in_executor(None, self.run_once)
            try:
                await asyncio.shield(self._running)
            finally:
                if self._running.done():
                    self._running = None
            await asyncio.sleep(settings.interval_secs)

    def _due(self, last: float | None, interval: float) -> bool:
        return last is None or self._clock() - last >= interval

    def run_once(self) -> dict[str, object]:
        """One pass (blocking; the loop runs it in a worker thread). Returns what each task did."""
        tasks: list[tuple[str, Callable[[], object]]] = [
            ("idle_sweep", self.cache.sweep_idle),
            ("pressure_sweep", self.cache.sweep_pressure),
            ("prune", self._prune),
            ("ledger", self.store._obligations.housekeeping),
            ("seen_messages", self.store._queue.prune_seen),
            ("fts_rebuild", self._rebuild),
            ("degraded_retry", self._retry_sql),
            ("sessions_json", self.store._fallback.flush_mirror),
        ]
        results: dict[str, object] = {}
        for name, task in tasks:
            try:
                results[name] = task()
            except Exception as exc:
                logger.exception("housekeeping task %s failed", name)
                results[name] = exc
        return results

    def _prune(self) -> int | None:
        interval = self.config.gateway.housekeeping.prune_interval_secs
        if not self._due(self._last_prune, interval):
            return None
        self._last_prune = self._clock()
        return self.store.prune_old_entries(self.config.gateway.session_store_max_age_days)

    def _rebuild(self) -> bool | None:
        if self.store.health()["fts"] != "stale":
            return None
        if not self._due(self._last_rebuild, FTS_REBUILD_INTERVAL_SECS):
            return None
        self._last_rebuild = self._clock()
        return self.store.rebuild_search_index()

    def _retry_sql(self) -> bool | None:
        return self.store._fallback.try_leave_degraded() if self.store.degraded else None
