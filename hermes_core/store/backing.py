"""The backend a store runs on: chosen by the scheme of ``storage.url``, checked against its
``StoreSpec``, and swapped for the core's JSONL fallback (degraded mode) when a local database
cannot be opened or turns out to be corrupt.

Every service of the store reaches the backend through one :class:`Backing`, and reads its
``backend`` and ``bound`` afresh on each use, so a switch into degraded mode (or back out of it,
``fallback``) reaches them all at once; the entry cache is kept across the switch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    CorruptDatabaseError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
)
from hermes_core.domain.keys import KeySchema
from hermes_core.domain.specs import LifecycleEvent, StoreCapability, StoreSpec
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import Maintenance, StoreBackend
from hermes_core.store.capabilities import WITHOUT, BoundBackend, bind_backend
from hermes_core.store.entries import EntryCache
from hermes_core.store.jsonl import JsonlBackend
from hermes_core.store.keyschema import recorded_key_schema
from hermes_core.store.mirror import MirrorWriter, load_mirror
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

DEGRADED_WARNING = "SQL session store unavailable, falling back to JSONL: "


def _bind_nothing(index: int) -> None:
    """A backend with one writer connection: every thread shares it."""


class _Canonical:
    """The context of :attr:`Backing.canonical`, one per store (it holds no state): a class,
    since a generator-based context costs several times as much on every store operation."""

    __slots__ = ("_backing",)

    def __init__(self, backing: Backing) -> None:
        self._backing = backing

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, CorruptDatabaseError):
            self._backing.corrupt(exc)


class Backing:
    """The opened backend, its capabilities, degraded mode and the store's key schema.

    ``cache`` and ``mirror`` are the store's entry cache and sessions.json writer: entering
    degraded mode writes the newest routing state the process knows into the mirror, which
    the JSONL fallback then reads as its routing index."""

    def __init__(
        self,
        config: GatewayConfig,
        plugins: HermesPluginManager,
        sessions_dir: Path,
        cache: EntryCache,
        mirror: MirrorWriter,
        *,
        read_only: bool,
        rekeying: bool,
    ) -> None:
        self._config = config
        self._plugins = plugins
        self._sessions_dir = sessions_dir
        self._cache = cache
        self._mirror = mirror
        self._read_only = read_only
        self.degraded_reason: str | None = None
        self.canonical = _Canonical(self)
        """Around a use of the canonical database: switch to degraded mode when it turns out
        to be corrupt (the error propagates all the same)."""
        self.bound: BoundBackend = self._open()
        self.backend: StoreBackend = self.bound.backend
        self.key_schema: KeySchema = config.keys.key_schema
        """The schema of the store's session keys (``keys.schema``, checked against the
        store's record where the backend keeps one: the ``maintenance`` capability)."""
        meta = self.bound.maintenance
        if meta is not None:
            try:
                self.key_schema = self.recorded_schema(self.backend, meta, rekeying=rekeying)
            except BaseException:
                self.backend.close()
                raise

    # -- opening -----------------------------------------------------------------------------------

    def spec(self) -> StoreSpec:
        """The storage backend registered for the scheme of ``storage.url``."""
        scheme = self._config.storage_url.split("://", 1)[0]
        stores = self._plugins.stores()
        spec = stores.get(scheme)
        if spec is None:
            known = ", ".join(sorted(stores)) or "none"
            raise StoreUnavailableError(
                f"storage.url uses the scheme {scheme!r}, which no loaded plugin provides "
                f"(known: {known}); fix storage.url or install the plugin for it."
            )
        return spec

    def bind(self, spec: StoreSpec, backend: object) -> BoundBackend:
        """``backend`` checked against ``spec`` (closed if it fails the check)."""
        try:
            return bind_backend(spec, backend, self._plugins.store_plugin(spec))
        except BaseException:
            getattr(backend, "close", lambda: None)()
            raise

    def _open(self) -> BoundBackend:
        """The backend for ``storage.url``; a local store (capability ``local_state``) that
        cannot be used falls back to JSONL (unless read-only: there is nothing to fall back for). A
        database whose writer lock another process holds is never a reason to fall back: that
        raises ``GatewayLockedError``."""
        url = self._config.storage_url
        spec = self.spec()
        opener = spec.open
        if self._read_only:
            if spec.open_read_only is None:
                raise StoreUnavailableError(
                    f"the {spec.name} store cannot be opened read-only; open it for writing."
                )
            opener = spec.open_read_only
        try:
            backend = opener(url, self._config)
        except SchemaVersionError:
            raise
        except StoreError as exc:
            if self._read_only or "local_state" not in spec.capabilities:
                raise  # a shared store (PostgreSQL) never falls back to local files
            return self._degrade(str(exc))
        return self.bind(spec, backend)

    def recorded_schema(
        self, backend: StoreBackend, sql: Maintenance, *, rekeying: bool
    ) -> KeySchema:
        """The key schema ``backend`` records (``sql``: its maintenance capability; see
        :func:`~hermes_core.store.keyschema.recorded_key_schema`)."""
        return recorded_key_schema(
            backend, sql, self._config, self._plugins, self._mirror.path,
            rekeying=rekeying, read_only=self._read_only,
        )  # fmt: skip

    def transaction(self) -> AbstractContextManager[object]:
        """A transaction of the backend in use (the writer's batches run in one)."""
        return self.backend.transaction()

    def open_writer(
        self,
        on_abort: Callable[[], None],
        prepare: Callable[[list[str]], AbstractContextManager[object]],
    ) -> StoreWriter:
        """The store's writer over this backend: one thread per writer connection, each bound
        to its connection (the JSONL fallback, degraded or not, is written by one thread);
        ``on_abort`` runs after a batch is rolled back, ``prepare`` around each batch's steps
        (see :class:`StoreWriter`)."""
        bound = self.bound
        threads, bind = 1, _bind_nothing
        if bound.writers is not None:
            threads, bind = bound.writers.writer_connections(), bound.writers.bind_writer
        return StoreWriter(
            self.transaction, on_abort,
            atomic=lambda: "atomic_batches" in self.bound.spec.capabilities,
            read_only=self._read_only, threads=threads, bind=bind,
            lock_order=bound.leases is not None,
            observe=self._committed if self._plugins.observing else None, prepare=prepare,
        )  # fmt: skip

    def _committed(self, seconds: float, steps: int) -> None:
        """Tell observers of a commit: how long it took and how many writer steps it held."""
        detail = {"seconds": seconds, "steps": steps}
        self._plugins.notify(LifecycleEvent(kind="store_committed", detail=detail))

    def use(self, bound: BoundBackend) -> None:
        """Run on ``bound`` from now on."""
        self.bound, self.backend = bound, bound.backend

    # -- degraded mode -----------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """True while the store runs on the JSONL fallback."""
        return self.degraded_reason is not None

    def _degrade(self, reason: str) -> BoundBackend:
        """The core's JSONL fallback (one warning, which covers what it does not offer)."""
        logger.warning("%s%s", DEGRADED_WARNING, reason)
        self.degraded_reason = reason
        spec = StoreSpec(
            name="jsonl", schemes=("jsonl",), open=self._open_jsonl, capabilities={"local_state"}
        )
        return bind_backend(spec, spec.open("", self._config), "hermes_core", warn=False)

    def _open_jsonl(self, url: str, config: GatewayConfig) -> JsonlBackend:
        return JsonlBackend(self._sessions_dir, self._plugins)

    def corrupt(self, error: CorruptDatabaseError) -> None:
        """A local canonical database found corrupt: continue degraded (see :attr:`canonical`)."""
        if not self.degraded and "local_state" in self.bound.spec.capabilities:
            self._enter_degraded(error)

    def _enter_degraded(self, error: CorruptDatabaseError) -> None:
        """Canonical corruption: keep working on JSONL; the database file is left for doctor."""
        logger.error("%s", error)
        cached = self._cache.as_dicts()
        mirror = load_mirror(self._mirror.path, self._plugins)
        merged: dict[str, Any] = dict(mirror.unregistered)
        merged.update({key: entry.to_dict() for key, entry in mirror.entries.items()})
        merged.update(cached)  # the cache holds the newest state of the lanes it knows
        self._mirror.write(merged, self._cache.routing_revision + 1)
        try:
            self.backend.close()
        except StoreError:
            logger.debug("closing the corrupt store failed", exc_info=True)
        self.use(self._degrade(str(error)))

    def leave_degraded(self, bound: BoundBackend) -> None:
        """Close the JSONL fallback and run on ``bound`` (the SQL store, usable again)."""
        self.backend.close()
        self.use(bound)
        self.degraded_reason = None

    def without(self, capability: StoreCapability, what: str) -> str:
        """The sentence saying that ``what`` needs ``capability`` and what to do about it."""
        if self.degraded:
            return (
                f"{what} is not available while the SQL store is unavailable (degraded JSONL "
                "mode); nothing was changed. Repair or restore the database (see "
                "'hermes-sessions doctor') and retry."
            )
        return (
            f"{what} needs a storage backend offering {capability!r}, and "
            f"{self.bound.spec.name!r} does not ({WITHOUT[capability]}); nothing was changed. "
            "Choose a storage.url whose backend offers it."
        )

    def health(self) -> dict[str, Any]:
        """See :meth:`~hermes_core.store.SessionStore.health`."""
        backend = self.backend.health()
        ledger = "enabled" if self._config.gateway.delivery_ledger.enabled else "disabled"
        bound = self.bound
        return {
            "backend": bound.spec.name,
            "available": backend.get("available", True),
            "unavailable_reason": backend.get("unavailable_reason"),
            "read_only": self._read_only,
            "degraded": self.degraded,
            "degraded_reason": self.degraded_reason,
            "fts": backend.get("fts", "unavailable") if bound.search else "unavailable",
            "ledger": "unavailable" if bound.ledger is None else ledger,
            "queue_persistent": bound.queue is not None,
            "capabilities": bound.offers(),
        }
