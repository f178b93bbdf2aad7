"""The ``sessions.json`` mirror of the routing index and the way back out of degraded mode.

With a SQL store the mirror is a copy written by housekeeping, bulk changes and ``close`` (never
on the per-message path); an existing gateway's sessions.json is imported into an empty routing
table once. While degraded the JSONL fallback is the store (``backing``); once SQL opens again
its backlog is replayed into it, exactly once (``replay``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import StoreError, StoreUnavailableError, shown
from hermes_core.domain.keys import origin_keys_to
from hermes_core.domain.models import SessionEntry
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import Maintenance
from hermes_core.store.backing import Backing
from hermes_core.store.base import MIRROR_IMPORTED, PhaseProgress, exclusive, untold
from hermes_core.store.capabilities import BoundBackend
from hermes_core.store.entries import EntryCache
from hermes_core.store.mirror import (
    MirrorTooLargeError,
    MirrorWriter,
    load_mirror,
    writes_mirror,
)
from hermes_core.store.replay import ReplayReport, replay_backlog, session_row_from_entry
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)


class Fallback:
    """The mirror file (``mirror``) kept after the routing index, its import, and the replay
    of the degraded mode's backlog (the files in ``sessions_dir``)."""

    def __init__(
        self,
        backing: Backing,
        cache: EntryCache,
        writer: StoreWriter,
        mirror: MirrorWriter,
        sessions_dir: Path,
        config: GatewayConfig,
        plugins: HermesPluginManager,
        *,
        read_only: bool,
    ) -> None:
        self._backing = backing
        self._cache = cache
        self._writer = writer
        self._mirror = mirror
        self._sessions_dir = sessions_dir
        self._config = config
        self._plugins = plugins
        self._read_only = read_only
        self._mirror_revision = -1
        """The routing revision the file was last written at; none yet, so a process writes it
        once after opening whatever it holds (a run killed before its final rewrite, a prune
        or re-key, leaves it outdated only until then)."""
        self._mirror_written_at = 0.0
        self._too_large = False
        """The routing index was found past ``gateway.sessions_json_max_lanes``: no mirror."""

    # -- sessions.json -----------------------------------------------------------------------------

    def import_once(self, sql: Maintenance) -> None:
        """Import an existing gateway's sessions.json into an empty routing table, once."""
        with self._backing.canonical:
            if sql.get_meta(MIRROR_IMPORTED) is not None or sql.has_routes():
                return
        if self.import_sessions_json(self._mirror.path):
            logger.warning("imported the routing index from %s", self._mirror.path)

    @exclusive
    def import_sessions_json(
        self, path: str | Path, *, strict: bool = False, progress: PhaseProgress | None = None
    ) -> int:
        """Import the entries of a sessions.json whose keys the routing table lacks. A file that
        is missing or not a JSON object imports nothing with a warning, or with ``strict`` (a
        file an operator named) raises :class:`InvalidValueError` before anything is written.
        ``progress`` is told of each entry ``reading`` (checked and made into rows), then of
        the entries ``writing`` once their one transaction commits."""
        meta = self._backing.bound.maintenance
        if meta is None:
            raise StoreUnavailableError(
                self._backing.without("maintenance", "Importing sessions.json")
            )
        told = progress or untold
        loaded = load_mirror(Path(path), self._plugins, strict=strict).entries
        entries = []
        for entry in loaded.values():
            if self._origin_matches(entry, path):
                row = session_row_from_entry(entry, parent_session_id=entry.prev_session_id)
                entries.append((entry.to_dict(), row))
            told("reading", 1, total=len(loaded))
        with self._backing.canonical:
            imported = meta.import_routes(entries, (MIRROR_IMPORTED, str(time.time())))
        told("writing", len(entries), total=len(entries))
        if imported:
            self._cache.routing_changed()
            self.flush_mirror(force=True)
        return imported

    def _origin_matches(self, entry: SessionEntry, path: str | Path) -> bool:
        """Whether an imported entry's origin is its own chat (the start-up resume and the
        ledger send to the origin); one naming another chat is skipped with a warning."""
        if entry.origin is None or origin_keys_to(
            entry.origin, entry.session_key, self._config, self._plugins
        ):
            return True
        logger.warning(
            "sessions.json %s: skipping entry %s: its origin is another chat than its key names",
            path, shown(entry.session_key),
        )  # fmt: skip
        return False

    def flush_mirror(self, *, force: bool = False) -> bool:
        """Rewrite sessions.json if routing changed (at most once per interval unless ``force``).

        Never on the per-message path: housekeeping, ``close`` and bulk changes call it. The
        entries are streamed from the routing table to the file (memory bounded whatever the
        number of lanes); past ``gateway.sessions_json_max_lanes`` nothing is written and an old
        file is removed (:meth:`_switch_off`).
        """
        backing = self._backing
        if (
            backing.degraded
            or not writes_mirror(self._config, backing.bound.spec)
            or self._read_only
        ):
            return False
        revision = self._cache.routing_revision
        interval = self._config.gateway.sessions_json_interval_secs
        if revision == self._mirror_revision and (self._too_large or self._mirror.path.exists()):
            return False
        if not force and time.monotonic() - self._mirror_written_at < interval:
            return False
        limit = self._config.gateway.sessions_json_max_lanes
        sql = backing.bound.maintenance
        try:
            with backing.canonical:
                lanes = sql.count_routes() if sql is not None else None
                if lanes is not None and lanes > limit:
                    raise MirrorTooLargeError(f"{lanes} routing entries")  # skip the walk
                routes = ((entry["session_key"], entry) for entry in backing.backend.iter_routes())
                written = self._mirror.write(routes, revision, max_entries=limit)
            self._too_large = False
        except MirrorTooLargeError:
            written = self._switch_off(limit)
        except StoreError as exc:
            logger.warning("sessions.json mirror not written (the SQL store is intact): %s", exc)
            return False
        self._mirror_revision = revision
        self._mirror_written_at = time.monotonic()
        return written

    def _switch_off(self, limit: int) -> bool:
        """Past the limit: no mirror, and no old one left for a tool to take as current. One
        warning per process (and per switch back off). False: nothing was written."""
        try:
            removed = self._mirror.remove()
        except StoreError as exc:
            logger.warning("%s", exc)
            removed = False
        if not self._too_large:
            logger.warning(
                "sessions.json is not written: the routing index has more than "
                "gateway.sessions_json_max_lanes (%d) lanes, and each rewrite would cost disk "
                "writes in proportion%s; raise gateway.sessions_json_max_lanes to keep writing it",
                limit,
                f" (removed the outdated {self._mirror.path})" if removed else "",
            )  # fmt: skip
        self._too_large = True
        return False

    def rewrite_mirror(self) -> bool:
        """Rewrite sessions.json from the routing table now, whatever the file holds (for
        ``doctor --fix``); False when no mirror is written."""
        self._cache.routing_changed()
        return self.flush_mirror(force=True)

    # -- leaving degraded mode ---------------------------------------------------------------------

    @exclusive
    def replay_backlog(self) -> ReplayReport | None:
        """Import the JSONL backlog into SQL exactly once (step ``jsonl_backlog_replay``);
        None while degraded (nothing to import into)."""
        meta = self._backing.bound.maintenance
        if meta is None:
            return None
        with self._backing.canonical:
            report = replay_backlog(self._sessions_dir, meta, self._plugins)
        if report.routes_inserted or report.routes_updated:
            self._cache.clear()  # replayed routes replace what the cache knew
            self._cache.routing_changed()
        self.flush_mirror(force=True)
        return report

    def try_leave_degraded(self) -> bool:
        """While degraded, try the SQL store again; on success replay the backlog into it and
        leave degraded mode (housekeeping calls this). True when SQL is in use afterwards."""
        backing = self._backing
        if not backing.degraded:
            return True
        try:
            spec = backing.spec()
            bound = backing.bind(spec, spec.open(self._config.storage_url, self._config))
        except StoreError as exc:
            logger.debug("the SQL store is still unavailable: %s", exc)
            return False
        try:
            if bound.maintenance is not None:
                backing.recorded_schema(bound.backend, bound.maintenance, rekeying=False)
        except StoreError as exc:
            bound.backend.close()
            logger.error("the SQL store is available again but cannot be used: %s", exc)
            return False
        self._writer.run(self._switch_to, bound)  # no lane operation runs during the switch
        logger.warning("the SQL session store is available again; replaying the JSONL backlog")
        self.replay_backlog()
        return True

    def _switch_to(self, bound: BoundBackend) -> None:
        self._backing.leave_degraded(bound)
        self._cache.clear()
