"""Where a store keeps its stuck-loop counts (lanes a restart found interrupted, by lane): in
the store itself, tagged with this instance, when the backend offers ``restart_counts``
(instances may share it), else in ``$HERMES_HOME/restart_counts.json``."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from hermes_core.config.schema import GatewayConfig
from hermes_core.state.instance import RestartCounter, RestartCounts, instance_id
from hermes_core.store.backend import RestartCountRows
from hermes_core.store.backing import Backing


class StoredRestartCounts:
    """Stuck-loop counts kept in the store, tagged with this instance (the in-memory copy is
    locked: writer threads of different lanes clear their counts at once)."""

    def __init__(self, rows: RestartCountRows, owner: str) -> None:
        self.rows = rows
        self.owner = owner
        self._counts: dict[str, int] | None = None
        self._lock = threading.RLock()

    def load(self) -> dict[str, int]:
        """The counts of the lanes this instance struck last (read once, then kept)."""
        with self._lock:
            if self._counts is None:
                self._counts = self.rows.restart_counts(self.owner)
            return dict(self._counts)

    def save(self, counts: Mapping[str, int]) -> None:
        """Replace this instance's counts."""
        with self._lock:
            self.rows.save_restart_counts(self.owner, counts)
            self._counts = dict(counts)

    def remove(self, session_key: str) -> None:
        """Forget a lane's count; no write when it has none."""
        with self._lock:
            if session_key not in self.load():
                return
            self.rows.remove_restart_count(session_key)
            if self._counts is not None:
                self._counts.pop(session_key, None)


class RestartCountStore:
    """The store's stuck-loop counts: opened on first use from the backend then in use."""

    def __init__(self, backing: Backing, config: GatewayConfig) -> None:
        self._backing = backing
        self._config = config
        self._counts: RestartCounter | None = None

    def open(self) -> RestartCounter:
        """New counts over where the backend in use keeps them (see the module)."""
        rows = self._backing.bound.counts
        if rows is not None:
            owner = instance_id(self._config.hermes_home, self._config.gateway.instance_id)
            return StoredRestartCounts(rows, owner)
        return RestartCounts(self._config.hermes_home)

    @property
    def current(self) -> RestartCounter:
        """This store's counts (opened once, see :meth:`open`)."""
        if self._counts is None:
            self._counts = self.open()
        return self._counts
