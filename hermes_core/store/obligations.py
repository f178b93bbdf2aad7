"""The store's delivery ledger: the rows of replies owed (``ledger`` capability), wrapped in the
:class:`~hermes_core.turns.ledger.DeliveryLedger` that claims and settles them, and their
housekeeping."""

from __future__ import annotations

from hermes_core.config.schema import GatewayConfig
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backing import Backing
from hermes_core.store.base import MAINTENANCE_BATCH, exclusive
from hermes_core.store.writer import StoreWriter
from hermes_core.turns.ledger import DeliveryLedger


class Obligations:
    """The delivery ledger over the backend in use (none when disabled or not offered)."""

    def __init__(
        self,
        backing: Backing,
        writer: StoreWriter,
        config: GatewayConfig,
        plugins: HermesPluginManager,
    ) -> None:
        self._backing = backing
        self._writer = writer
        self._config = config
        self._plugins = plugins
        self._ledger: DeliveryLedger | None = None

    @property
    def ledger(self) -> DeliveryLedger | None:
        """The delivery ledger, or None when disabled or unavailable (a backend without the
        ``ledger`` capability, degraded mode included)."""
        settings = self._config.gateway.delivery_ledger
        rows = self._backing.bound.ledger
        if rows is None or not settings.enabled:
            return None
        if self._ledger is None or self._ledger.rows is not rows:
            notify = self._plugins.notify if self._plugins.observing else None
            self._ledger = DeliveryLedger(rows, settings, notify)
        return self._ledger

    def housekeeping(self) -> int | None:
        """The ledger's housekeeping (None without a ledger): stale rows abandoned, then the
        rows past retention or the row cap deleted in batches of :data:`MAINTENANCE_BATCH`,
        each a writer step of its own, so that turns' steps run between them; the count."""
        ledger = self.ledger
        return None if ledger is None else ledger.housekeeping(self._prune)

    def _prune(self, obligation_ids: list[str]) -> int:
        return sum(
            self._prune_batch(obligation_ids[start : start + MAINTENANCE_BATCH])
            for start in range(0, len(obligation_ids), MAINTENANCE_BATCH)
        )

    @exclusive
    def _prune_batch(self, obligation_ids: list[str]) -> int:
        rows = self._backing.bound.ledger
        if rows is None:
            return 0
        with self._backing.canonical:
            return rows.delete_terminal_obligations(obligation_ids)
