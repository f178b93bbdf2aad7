"""The plumbing under :class:`~hermes_core.store.SessionStore`: backend selection, degraded
mode, the bounded entry cache, the sessions.json mirror, health and closing.

One module on purpose: backend selection, degraded mode and the entry cache switch together
(a degraded store swaps its backend and keeps its cache).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    CorruptDatabaseError,
    InvalidValueError,
    KeySchemaError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
    shown,
)
from hermes_core.domain.keys import KeySchema, origin_keys_to, resolve_key
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.domain.recent import Recent
from hermes_core.domain.specs import LifecycleEvent, LifecycleKind, StoreCapability, StoreSpec
from hermes_core.domain.text import clean_text
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.state.files import ensure_private_dir
from hermes_core.store.backend import SESSION_ENDED, Maintenance, ParallelWriters, StoreBackend
from hermes_core.store.capabilities import WITHOUT, BoundBackend, bind_backend
from hermes_core.store.jsonl import JsonlBackend
from hermes_core.store.mirror import MirrorWriter, load_mirror, read_mirror, writes_mirror
from hermes_core.store.replay import ReplayReport, replay_backlog, session_row_from_entry
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

DEGRADED_WARNING = "SQL session store unavailable, falling back to JSONL: "
MIRROR_IMPORTED = "sessions_json_imported"
KEY_SCHEMA_META = "key_schema"
"""``state_meta`` name of the store's session-key schema: ``v1``, ``v2`` or :data:`REKEYING`."""
REKEYING = "v1>v2"
MAINTENANCE_BATCH = 1_000
"""Rows one housekeeping step of the writer changes at most: a long pass goes in many short
steps, and the turns' steps run between them instead of waiting for the whole pass."""
"""The recorded schema while ``rekey`` moves lanes from v1 to v2 (until its last batch)."""

_S = TypeVar("_S", bound="StoreBase")
_P = ParamSpec("_P")
_T = TypeVar("_T")


def _bind_nothing(index: int) -> None:
    """A backend with one writer connection: every thread shares it."""


def new_session_id(now: datetime) -> str:
    """``YYYYMMDD_HHMMSS_<8 hex>`` from the creation time (UTC) and 32 random bits."""
    return f"{now:%Y%m%d_%H%M%S}_{secrets.token_hex(4)}"


def changed(entry: SessionEntry, updates: Mapping[str, Any]) -> SessionEntry:
    """A copy of ``entry`` with ``updates`` set, unvalidated (``model_copy``): the store's
    updates are values it made itself, and the entry in its cache must not change."""
    return entry.model_copy(update=updates)


def _on_writer(
    method: Callable[Concatenate[_S, _P], _T], *, alone: bool
) -> Callable[Concatenate[_S, _P], _T]:
    def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        writer = self._writer
        if writer.on_writer_thread:
            return method(self, *args, **kwargs)
        return writer.run(functools.partial(method, self, *args, **kwargs), alone=alone)

    functools.update_wrapper(run, method)
    return run


def serialised(method: Callable[Concatenate[_S, _P], _T]) -> Callable[Concatenate[_S, _P], _T]:
    """Run a mutating store method on the store's writer thread (see ``writer``): it returns
    once its writes are committed, and never interleaves with another mutation."""
    return _on_writer(method, alone=False)


def exclusive(method: Callable[Concatenate[_S, _P], _T]) -> Callable[Concatenate[_S, _P], _T]:
    """Like :func:`serialised`, but outside any group commit: for maintenance whose own reads
    (through other connections) must see what it has just written."""
    return _on_writer(method, alone=True)


class _Canonical:
    """The context of :meth:`StoreBase._canonical`, one per store (it holds no state): a class,
    since a generator-based context costs several times as much on every store operation."""

    __slots__ = ("_store",)

    def __init__(self, store: StoreBase) -> None:
        self._store = store

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, CorruptDatabaseError):
            self._store._corrupt(exc)


class StoreBase:
    """Backend, cache and mirror shared by the store's operations (not used on its own)."""

    def __init__(
        self,
        sessions_dir: str | Path,
        config: GatewayConfig,
        has_active_processes_fn: Callable[[str], bool] | None = None,
        *,
        plugins: HermesPluginManager | None = None,
        entry_cache_size: int = 10_000,
        read_only: bool = False,
        rekeying: bool = False,
    ) -> None:
        """``rekeying``: open a store whose recorded key schema differs from ``keys.schema``
        (or whose re-key was interrupted), for :meth:`~hermes_core.store.SessionStore.rekey`."""
        self.config = config
        self._canonical_guard = _Canonical(self)
        self.read_only = read_only
        """Opened to read only: no writer lock is taken and every change is refused
        (``ReadOnlyStoreError``), so it may be opened beside a running gateway."""
        # Read-only creates nothing: an operator's `ls` must not leave directories behind.
        directory = Path(sessions_dir)
        if directory.is_symlink():  # refused like a symlinked database file
            raise StoreError(
                f"{directory}: the sessions directory is a symlink, which the store never "
                "follows (nor a symlinked state.db); set gateway.sessions_dir to the directory "
                "it points at, or put that directory in its place."
            )
        self.sessions_dir = directory if read_only else ensure_private_dir(directory)
        self.plugins = plugins if plugins is not None else default_plugin_manager(config)
        self._has_active_processes = has_active_processes_fn
        self._cache_size = entry_cache_size
        self._map_lock = threading.Lock()
        self._entries: Recent[str, SessionEntry] = Recent(entry_cache_size)
        self._revisions: dict[str, int] = {}
        """Shared store: the row revision of keys as last read or written here (``routing``)."""
        self._mirror = MirrorWriter(self.sessions_dir / "sessions.json")
        self._routing_revision = 0
        self._mirror_revision = 0
        self._mirror_written_at = 0.0
        self._unloadable_warned: set[str] = set()
        self._degraded_reason: str | None = None
        self._closed = False
        self._bound: BoundBackend = self._open_backend()
        self._backend: StoreBackend = self._bound.backend
        self.key_schema: KeySchema = config.keys.key_schema
        """The schema of this store's session keys (``keys.schema``, checked against the
        store's record where the backend keeps one: the ``maintenance`` capability)."""
        meta = self._bound.maintenance
        if meta is not None:
            try:
                self.key_schema = self._key_schema_of(self._backend, meta, rekeying=rekeying)
            except BaseException:
                self._backend.close()
                raise
        self._writer = self._open_writer(read_only)
        if meta is not None and not read_only:
            self._import_mirror_once(meta)

    def _open_writer(self, read_only: bool) -> StoreWriter:
        """The writer: one thread per writer connection of the backend, each bound to its
        connection (the JSONL fallback, degraded or not, is written by one thread)."""
        lanes, bind = 1, _bind_nothing
        if self._bound.spec.parallel_writers:
            parallel = cast(ParallelWriters, self._backend)
            lanes, bind = parallel.writer_connections(), parallel.bind_writer
        return StoreWriter(
            self._transaction, self._drop_cache, atomic=lambda: self._bound.spec.atomic_batches,
            read_only=read_only, lanes=lanes, bind=bind, lock_order=self._bound.leases is not None,
        )  # fmt: skip

    def _transaction(self) -> AbstractContextManager[object]:
        return self._backend.transaction()

    def _drop_cache(self) -> None:
        """After a rolled-back write batch: the cache may hold uncommitted entries."""
        with self._map_lock:
            self._entries.clear()
            self._revisions.clear()

    # -- backend selection and degraded mode -------------------------------------------------------

    def _spec(self) -> StoreSpec:
        """The storage backend registered for the scheme of ``storage.url``."""
        scheme = self.config.storage_url.split("://", 1)[0]
        stores = self.plugins.stores()
        spec = stores.get(scheme)
        if spec is None:
            known = ", ".join(sorted(stores)) or "none"
            raise StoreUnavailableError(
                f"storage.url uses the scheme {scheme!r}, which no loaded plugin provides "
                f"(known: {known}); fix storage.url or install the plugin for it."
            )
        return spec

    def _bind(self, spec: StoreSpec, backend: object) -> BoundBackend:
        """``backend`` checked against ``spec`` (closed if it fails the check)."""
        try:
            return bind_backend(spec, backend, self.plugins.store_plugin(spec))
        except BaseException:
            getattr(backend, "close", lambda: None)()
            raise

    def _open_backend(self) -> BoundBackend:
        """The backend for ``storage.url``; a local store (``StoreSpec.local``) that cannot be
        used falls back to JSONL (unless read-only: there is nothing to fall back for). A
        database whose writer lock another process holds is never a reason to fall back: that
        raises ``GatewayLockedError``."""
        url = self.config.storage_url
        spec = self._spec()
        opener = spec.open
        if self.read_only:
            if spec.open_read_only is None:
                raise StoreUnavailableError(
                    f"the {spec.name} store cannot be opened read-only; open it for writing."
                )
            opener = spec.open_read_only
        try:
            backend = opener(url, self.config)
        except SchemaVersionError:
            raise
        except StoreError as exc:
            if self.read_only or not spec.local:
                raise  # a shared store (PostgreSQL) never falls back to local files
            return self._degrade(str(exc))
        return self._bind(spec, backend)

    def _key_schema_of(
        self, backend: StoreBackend, sql: Maintenance, *, rekeying: bool
    ) -> KeySchema:
        """The key schema recorded in ``backend`` (``sql`` is its maintenance capability),
        recorded first for a store that has none (see :meth:`_unrecorded_schema`). Unless
        ``rekeying``, it must be ``keys.schema``: :class:`KeySchemaError` otherwise."""
        wanted = self.config.keys.key_schema
        recorded = sql.get_meta(KEY_SCHEMA_META)
        if recorded is None:
            recorded = self._unrecorded_schema(backend, sql)
            if not self.read_only:  # a reader tells it the same way each time
                sql.set_meta(KEY_SCHEMA_META, recorded)
        if recorded not in ("v1", "v2", REKEYING):
            raise KeySchemaError(
                f"the store records key schema {recorded!r}, which this hermes-sessions does not "
                "know; upgrade hermes-sessions."
            )
        if rekeying:
            return "v2" if recorded == "v2" else "v1"
        if recorded == REKEYING:
            raise KeySchemaError(
                "a re-key of this store to key schema v2 was interrupted; run `hermes-sessions "
                "rekey --to v2` again to finish it before starting the gateway."
            )
        if recorded == "v1" and wanted == "v2":
            raise KeySchemaError(
                "this store's session keys follow key schema v1 (the original gateway's layout) "
                "but keys.schema is v2 (the default): set keys.schema: v1 to keep them, or stop "
                "the gateway and run `hermes-sessions rekey --to v2` to move every lane to v2."
            )
        if recorded != wanted:
            raise KeySchemaError(
                "this store's session keys follow key schema v2 but keys.schema is v1: set "
                "keys.schema: v2 (or remove it); a v2 store is never moved back to v1."
            )
        return wanted

    def _unrecorded_schema(self, backend: StoreBackend, sql: Maintenance) -> KeySchema:
        """The schema of a store written before schemas were recorded: the one its routing
        entries (or the sessions.json it is about to import) are keyed in, told by comparing
        each key with its origin's keys; v1 when only session rows exist (they predate v2);
        ``keys.schema`` for new state."""
        lanes = [(entry["session_key"], entry.get("origin")) for entry in backend.iter_routes()]
        if not lanes and sql.get_meta(MIRROR_IMPORTED) is None:
            mirrored = read_mirror(self._mirror.path, self.plugins).values()
            lanes = [(entry.session_key, entry.to_dict().get("origin")) for entry in mirrored]
        for key, origin in lanes:
            try:
                v1, v2 = self.keys_in_both(SessionSource.from_dict(origin, plugins=self.plugins))
            except InvalidValueError:
                continue  # no origin, or one that cannot be keyed: this lane cannot tell
            if v1 != v2 and key in (v1, v2):
                return "v1" if key == v1 else "v2"
        if lanes or backend.count_sessions() > 0:
            return "v1"
        return self.config.keys.key_schema

    def keys_in_both(self, source: SessionSource) -> tuple[str, str]:
        """The v1 and v2 keys of ``source`` under this store's settings."""
        config, plugins = self.config, self.plugins
        v1 = resolve_key(source, config, plugins, schema="v1").key
        return v1, resolve_key(source, config, plugins, schema="v2").key

    def _degrade(self, reason: str) -> BoundBackend:
        """The core's JSONL fallback (one warning, which covers what it does not offer)."""
        logger.warning("%s%s", DEGRADED_WARNING, reason)
        self._degraded_reason = reason
        spec = StoreSpec(
            name="jsonl", schemes=("jsonl",), open=self._open_jsonl,
            local=True,
        )  # fmt: skip
        return bind_backend(spec, spec.open("", self.config), "hermes_core", warn=False)

    def _open_jsonl(self, url: str, config: GatewayConfig) -> JsonlBackend:
        return JsonlBackend(self.sessions_dir, self.plugins)

    def _enter_degraded(self, error: CorruptDatabaseError) -> None:
        """Canonical corruption: keep working on JSONL; the database file is left for doctor."""
        logger.error("%s", error)
        with self._map_lock:
            cached = {key: entry.to_dict() for key, entry in self._entries.items()}
        mirror = load_mirror(self._mirror.path, self.plugins)
        merged: dict[str, Any] = dict(mirror.unregistered)
        merged.update({key: entry.to_dict() for key, entry in mirror.entries.items()})
        merged.update(cached)  # the cache holds the newest state of the lanes it knows
        self._mirror.write(merged, self._routing_revision + 1)
        try:
            self._backend.close()
        except StoreError:
            logger.debug("closing the corrupt store failed", exc_info=True)
        self._use(self._degrade(str(error)))

    def _use(self, bound: BoundBackend) -> None:
        self._bound, self._backend = bound, bound.backend

    def _canonical(self) -> _Canonical:
        """Around a use of the canonical database: switch to degraded mode when it turns out to
        be corrupt (the error propagates all the same)."""
        return self._canonical_guard

    def _corrupt(self, error: CorruptDatabaseError) -> None:
        """A local canonical database found corrupt: continue degraded (see :meth:`_canonical`)."""
        if not self.degraded and self._bound.spec.local:
            self._enter_degraded(error)

    @exclusive
    def replay_backlog(self) -> ReplayReport | None:
        """Import the JSONL backlog into SQL exactly once (step ``jsonl_backlog_replay``);
        None while degraded (nothing to import into)."""
        meta = self._bound.maintenance
        if meta is None:
            return None
        with self._canonical():
            report = replay_backlog(self.sessions_dir, meta, self.plugins)
        if report.routes_inserted or report.routes_updated:
            self._drop_cache()  # replayed routes replace what the cache knew
            self._routing_changed()
        self.flush_mirror(force=True)
        return report

    def try_leave_degraded(self) -> bool:
        """While degraded, try the SQL store again; on success replay the backlog into it and
        leave degraded mode (housekeeping calls this). True when SQL is in use afterwards."""
        if not self.degraded:
            return True
        try:
            spec = self._spec()
            bound = self._bind(spec, spec.open(self.config.storage_url, self.config))
        except StoreError as exc:
            logger.debug("the SQL store is still unavailable: %s", exc)
            return False
        try:
            if bound.maintenance is not None:
                self._key_schema_of(bound.backend, bound.maintenance, rekeying=False)
        except StoreError as exc:
            bound.backend.close()
            logger.error("the SQL store is available again but cannot be used: %s", exc)
            return False
        self._writer.run(self._switch_to, bound)  # no lane operation runs during the switch
        logger.warning("the SQL session store is available again; replaying the JSONL backlog")
        self.replay_backlog()
        return True

    def _switch_to(self, bound: BoundBackend) -> None:
        self._backend.close()
        self._use(bound)
        self._degraded_reason = None
        self._drop_cache()

    @property
    def degraded(self) -> bool:
        """True while the store runs on the JSONL fallback."""
        return self._degraded_reason is not None

    def _without(self, capability: StoreCapability, what: str) -> str:
        """The sentence saying that ``what`` needs ``capability`` and what to do about it."""
        if self.degraded:
            return (
                f"{what} is not available while the SQL store is unavailable (degraded JSONL "
                "mode); nothing was changed. Repair or restore the database (see "
                "'hermes-sessions doctor') and retry."
            )
        return (
            f"{what} needs a storage backend offering {capability!r}, and "
            f"{self._bound.spec.name!r} does not ({WITHOUT[capability]}); nothing was changed. "
            "Choose a storage.url whose backend offers it."
        )

    # -- entry cache -------------------------------------------------------------------------------

    def _remember(self, entry: SessionEntry, revision: int | None = None) -> None:
        self._cache(entry.session_key, entry, revision)

    def _cache(self, key: str, entry: SessionEntry | None, revision: int | None) -> None:
        """Cache the key's entry (None: nothing to cache); on a shared store with the
        ``revision`` of the row as read or written (None: no row, or not known; an entry is
        then dropped instead, to be read afresh), kept for as many keys as the cache holds."""
        shared = self._bound.leases is not None
        with self._map_lock:
            self._revisions.pop(key, None)
            if shared and revision is not None:
                self._revisions[key] = revision
                if len(self._revisions) > self._cache_size:
                    del self._revisions[next(iter(self._revisions))]
            if entry is None or (shared and revision is None):
                self._entries.pop(key, None)
                return
            for dropped in self._entries.put(key, entry):
                self._revisions.pop(dropped, None)

    def _forget(self, session_key: str) -> None:
        with self._map_lock:
            self._entries.pop(session_key, None)
            self._revisions.pop(session_key, None)

    def _parse(self, data: dict[str, Any] | Any) -> SessionEntry | None:
        """A stored entry, or None (warned once per platform) when it cannot be loaded."""
        try:
            return SessionEntry.from_dict(data, plugins=self.plugins)
        except InvalidValueError as exc:
            tag = str(getattr(exc, "field", "entry"))
            origin = data.get("origin") if isinstance(data, dict) else None
            platform = origin.get("platform") if isinstance(origin, dict) else None
            marker = f"{platform}" if platform else tag
            if marker not in self._unloadable_warned:
                self._unloadable_warned.add(marker)
                logger.warning(
                    "skipping stored session entries that cannot be loaded (%s); they stay in "
                    "the store and return once fixed (e.g. the platform plugin loads); "
                    "`hermes-sessions doctor` names them",
                    exc,
                )
            return None

    def _load(self, session_key: str) -> SessionEntry | None:
        """The entry of a key from the cache or the backend (a stale route counts as none).

        Only the writer thread fills the cache: a reader elsewhere could otherwise put back an
        entry older than one the writer has just cached. On a shared store it also records the
        row's revision, even of a row read as none (the write replacing it expects it)."""
        session_key = clean_text(session_key)  # as a key built from a source would have it
        with self._map_lock:
            entry = self._entries.use(session_key)
            if entry is not None:
                return entry
        leases, revision = self._bound.leases, None
        with self._canonical():
            if leases is None:
                data = self._backend.get_route(session_key)
            else:
                data, revision = leases.read_route(session_key) or (None, None)
            entry = ended = None
            if data is not None:
                entry, ended = self._parse(data), data.get(SESSION_ENDED)
            if entry is not None and ended is None:  # not told with the entry: read its session
                row = self._backend.get_session(entry.session_id)
                ended = row is not None and row.end_reason is not None
        if ended:
            entry = None  # stale route: its session ended at a boundary elsewhere
        if self._writer.on_writer_thread:
            self._cache(session_key, entry, revision)
        return entry

    def _current_entry_of(self, session_id: str) -> SessionEntry | None:
        """The cached (newest) entry whose current session id is ``session_id``, or None."""
        with self._canonical():
            data = self._backend.get_route_by_session_id(session_id)
        entry = self._parse(data) if data is not None else None
        if entry is None:
            return None
        cached = self._load(entry.session_key)
        return cached if cached is not None else entry

    def _routing_changed(self) -> None:
        with self._map_lock:
            self._routing_revision += 1

    def _notify(self, kind: LifecycleKind, entry: SessionEntry, **detail: Any) -> None:
        """Tell observers, once the change is committed."""
        if self.plugins.observing:
            event = LifecycleEvent(
                kind=kind, session_key=entry.session_key, session_id=entry.session_id, detail=detail
            )
            self._writer.after_commit(functools.partial(self.plugins.notify, event))

    @staticmethod
    def _snapshot(entry: SessionEntry) -> SessionEntry:
        """A copy for callers, so the cached entry never changes under them (or by them)."""
        metadata = copy.deepcopy(entry.metadata) if entry.metadata else {}
        return changed(entry, {"metadata": metadata})

    # -- sessions.json mirror --------------------------------------------------------

    def _import_mirror_once(self, sql: Maintenance) -> None:
        """Import an existing gateway's sessions.json into an empty routing table, once."""
        with self._canonical():
            if sql.get_meta(MIRROR_IMPORTED) is not None or sql.has_routes():
                return
        if self.import_sessions_json(self._mirror.path):
            logger.warning("imported the routing index from %s", self._mirror.path)

    @exclusive
    def import_sessions_json(self, path: str | Path, *, strict: bool = False) -> int:
        """Import the entries of a sessions.json whose keys the routing table lacks. A file that
        is missing or not a JSON object imports nothing with a warning, or with ``strict`` (a
        file an operator named) raises :class:`InvalidValueError` before anything is written."""
        meta = self._bound.maintenance
        if meta is None:
            raise StoreUnavailableError(self._without("maintenance", "Importing sessions.json"))
        entries = [
            (
                entry.to_dict(),
                session_row_from_entry(entry, parent_session_id=entry.prev_session_id),
            )
            for entry in load_mirror(Path(path), self.plugins, strict=strict).entries.values()
            if self._origin_matches(entry, path)
        ]
        with self._canonical():
            imported = meta.import_routes(entries, (MIRROR_IMPORTED, str(time.time())))
        if imported:
            self._routing_changed()
            self.flush_mirror(force=True)
        return imported

    def _origin_matches(self, entry: SessionEntry, path: str | Path) -> bool:
        """Whether an imported entry's origin is its own chat (the start-up resume and the
        ledger send to the origin); one naming another chat is skipped with a warning."""
        if entry.origin is None or origin_keys_to(
            entry.origin, entry.session_key, self.config, self.plugins
        ):
            return True
        logger.warning(
            "sessions.json %s: skipping entry %s: its origin is another chat than its key names",
            path, shown(entry.session_key),
        )  # fmt: skip
        return False

    def flush_mirror(self, *, force: bool = False) -> bool:
        """Rewrite sessions.json if routing changed (at most once per interval unless ``force``).

        Never on the per-message path: housekeeping, ``close`` and bulk changes call it.
        """
        if self.degraded or not writes_mirror(self.config, self._bound.spec) or self.read_only:
            return False
        with self._map_lock:
            revision = self._routing_revision
        interval = self.config.gateway.sessions_json_interval_secs
        if revision == self._mirror_revision and self._mirror.path.exists():
            return False
        if not force and time.monotonic() - self._mirror_written_at < interval:
            return False
        with self._canonical():
            snapshot = {entry["session_key"]: entry for entry in self._backend.iter_routes()}
        try:
            written = self._mirror.write(snapshot, revision)
        except StoreError as exc:
            logger.warning("sessions.json mirror not written (the SQL store is intact): %s", exc)
            return False
        self._mirror_revision = revision
        self._mirror_written_at = time.monotonic()
        return written

    def rewrite_mirror(self) -> bool:
        """Rewrite sessions.json from the routing table now, whatever the file holds (for
        ``doctor --fix``); False when no mirror is written."""
        self._routing_changed()
        return self.flush_mirror(force=True)

    # -- health, close -----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Backend, whether writes can be stored now (``available``, false while the database
        connection is lost, with ``unavailable_reason``), read-only mode, degraded state, search
        index, ledger and queue persistence, and which capabilities the backend offers."""
        backend = self._backend.health()
        ledger = "enabled" if self.config.gateway.delivery_ledger.enabled else "disabled"
        bound = self._bound
        return {
            "backend": bound.spec.name,
            "available": backend.get("available", True),
            "unavailable_reason": backend.get("unavailable_reason"),
            "read_only": self.read_only,
            "degraded": self.degraded,
            "degraded_reason": self._degraded_reason,
            "fts": backend.get("fts", "unavailable") if bound.search else "unavailable",
            "ledger": "unavailable" if bound.ledger is None else ledger,
            "queue_persistent": bound.queue is not None,
            "capabilities": bound.offers(),
        }

    def run(self, function: Callable[..., _T], *args: Any, lane: str | None = None) -> _T:
        """Run ``function(*args)`` as one step of the store's writer (its writes commit
        together, possibly with other callers' steps) and return once committed. ``lane``:
        the session key whose state it changes, so other lanes' steps may commit beside it on
        another writer connection; None: it runs alone, ordered against every step."""
        return self._writer.run(function, *args, lane=lane)

    async def arun(self, function: Callable[..., _T], *args: Any, lane: str | None = None) -> _T:
        """:meth:`run` for asyncio: the event loop stays free until the commit is done."""
        return await self._writer.arun(function, *args, lane=lane)

    def submit(
        self, function: Callable[..., _T], *args: Any, lane: str | None = None
    ) -> asyncio.Future[_T]:
        """Hand ``function(*args)`` to the writer now, in order with the lane's other steps
        (and every step without a lane), without waiting (asyncio): the returned future
        settles after its commit."""
        return self._writer.submit(function, *args, lane=lane)

    def atomically(self) -> AbstractContextManager[object]:
        """Within a writer step: one transaction around the writes inside, even when the step
        runs outside a batch (alone, after its batch failed), for writes that rely on a row
        lock an earlier one of them took."""
        return self._transaction()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Within a writer step: run ``callback`` once the step is committed (else at once)."""
        self._writer.after_commit(callback)

    def on_rollback(self, callback: Callable[[], None]) -> None:
        """Within a writer step: undo an in-memory change if the step's commit fails."""
        self._writer.on_rollback(callback)

    def stats(self) -> dict[str, int]:
        """What the store has done so far, for benchmarks: the backend's counters (commits,
        round trips) and the writer's (``batches`` committed, ``steps`` run)."""
        return {**self._backend.stats(), **self._writer.stats()}

    def close(self) -> None:
        """Finish the writes handed over, write the mirror if routing changed, then release the
        backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self.flush_mirror(force=True)
        finally:
            self._backend.close()
