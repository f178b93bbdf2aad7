"""Pruning of idle lanes' routing entries (``pruning`` capability): their sessions and messages
stay, and the next message of such a lane reopens its newest session or starts one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hermes_core.domain.timeutil import checked_span
from hermes_core.store.backing import Backing
from hermes_core.store.base import MAINTENANCE_BATCH, exclusive
from hermes_core.store.fallback import Fallback
from hermes_core.store.routing import RoutingTable
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)


class Pruner:
    """Removes idle routing entries, sparing the lanes ``has_active_processes(session_key)``
    says still run something (None: none does)."""

    def __init__(
        self,
        backing: Backing,
        routes: RoutingTable,
        writer: StoreWriter,
        fallback: Fallback,
        has_active_processes: Callable[[str], bool] | None,
    ) -> None:
        self._backing = backing
        self._routes = routes
        self._writer = writer
        self._fallback = fallback
        self._has_active_processes = has_active_processes

    def _has_active_process(self, session_key: str) -> bool:
        if self._has_active_processes is None:
            return False
        try:
            return bool(self._has_active_processes(session_key))
        except Exception:
            logger.warning("has_active_processes_fn failed; keeping the lane", exc_info=True)
            return True

    def prune_old_entries(self, max_age_days: float | None) -> int:
        """Remove routing entries idle for ``max_age_days`` (sessions and messages stay); None
        or 0 removes nothing, a value that is no finite number of days is refused. The number
        removed (:meth:`prune_idle_lanes` names them)."""
        return len(self.prune_idle_lanes(max_age_days))

    def prune_idle_lanes(
        self,
        max_age_days: float | None,
        *,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[str]:
        """:meth:`prune_old_entries`, returning the session keys of the entries removed.

        A walk over the candidates in key order, ``batch_size`` keys (default
        :data:`MAINTENANCE_BATCH`) at a time: each page is read after the last key of the one
        before, then removed in a writer step of its own (turns' steps run between them) whose
        delete re-checks that the lane is still idle, and ``progress`` is called with the number
        of lanes examined. No more than a page of rows is held, and each committed page stays
        removed, so a run interrupted anywhere is finished by running it again.
        """
        pruning = self._backing.bound.pruning
        if max_age_days is None or max_age_days == 0 or pruning is None:
            return []
        cutoff = time.time() - checked_span(max_age_days, "max_age_days") * 86_400
        size = batch_size or MAINTENANCE_BATCH
        removed: list[str] = []
        after: str | None = None
        while True:
            with self._backing.canonical:
                page = pruning.prune_candidates(cutoff, after, size)
            if not page:
                break
            after = page[-1]
            removed += self._prune_batch(
                [key for key in page if not self._has_active_process(key)], cutoff
            )
            if progress is not None:
                progress(len(page))
            if len(page) < size:
                break
        if removed:
            self._fallback.flush_mirror(force=True)
        return removed

    @exclusive
    def _prune_batch(self, keys: list[str], cutoff: float) -> list[str]:
        """Remove the entries of ``keys`` still idle since before ``cutoff`` (one step)."""
        pruning = self._backing.bound.pruning
        if pruning is None or not keys:
            return []
        with self._backing.canonical:
            removed = pruning.delete_idle_routes(keys, cutoff)
        for key in removed:
            self._routes.forget(key)
        if removed:
            self._routes.changed()
        return removed
