"""The routing index as the store's services use it: entries read through the entry cache,
lookups, lifecycle notifications, and writes from cached entries, checked on a store shared by
several gateway processes (optimistic concurrency on the routing row's ``revision``).

The store caches routing entries (``entries``); on a shared store another process may write a
lane's row after this one cached or read it, and a write from the stale copy would undo that
write (a ``/new`` made elsewhere, a turn's marker, a suspension). Every write of a row
increments its ``revision``; the cache keeps the revision each row was read or written at, and
a write of an entry changed from it (a touch, a flag, metadata, counters, a new, reset or
reopened session) applies only while the row still has that revision, a new key's only while
it has no row (:meth:`RoutingTable.write_entry`). Otherwise the backend writes nothing, the
stale copy is dropped and :class:`~hermes_core.domain.errors.RoutingConflictError` is raised.

Each such operation of the store is a function of the lane's current entry, so the store redoes
it on the row as it is now (:meth:`RoutingTable.redo`): what it does then is what it would
have done had it come after the other process's write. A touch, a flag or a metadata value is
applied to the current entry; counters are added to the lane's current session (as in one
process after a reset); a first session the other process created is taken as the lane's; a
reset ends the session the other process's reset started. Only when the row changes again on
every one of :data:`ROUTING_ATTEMPTS` attempts does the error reach the caller, nothing written.

A turn's marker writes (its start, its reply and its end) change only the marker columns and
the activity time, under the lane's lease and its fence: they are not checked, and the cached
revision moves on by one with each (:meth:`RoutingTable.bumped`), so another process's write in
between still shows at the next checked write, and at the next lease taken (``leases``), which
keeps a lane's cached entry only while the row's revision is the cached one (otherwise it caches
the entry read by the grant's own statement). Recovery's writes of the lanes it holds, read just
before, are not checked either and leave those lanes uncached. A single-instance store
checks nothing and keeps no revision: no statement more.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from hermes_core.domain.errors import InvalidValueError, RoutingConflictError
from hermes_core.domain.models import SessionEntry, session_id_problem
from hermes_core.domain.specs import LifecycleEvent, LifecycleKind
from hermes_core.domain.text import clean_text
from hermes_core.domain.timeutil import checked_span, utc_now
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store.backend import SESSION_ENDED, SessionRow
from hermes_core.store.backing import Backing
from hermes_core.store.base import changed
from hermes_core.store.entries import EntryCache
from hermes_core.store.writer import StoreWriter

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ROUTING_ATTEMPTS = 3
"""Attempts of one operation whose checked routing write finds the row changed each time."""


class RoutingTable:
    """Routing entries by session key: read through ``cache``, written to the backend of
    ``backing`` (checked on a shared store), and observers told once a change commits."""

    def __init__(
        self,
        backing: Backing,
        cache: EntryCache,
        writer: StoreWriter,
        plugins: HermesPluginManager,
    ) -> None:
        self._backing = backing
        self._cache = cache
        self._writer = writer
        self._plugins = plugins
        self._unloadable_warned: set[str] = set()
        self._batch = threading.local()
        """Per writer thread: ``absent``, the keys of its open batch read without a live route
        (:meth:`prefetched`)."""

    # -- reads -------------------------------------------------------------------------------------

    def parse(self, data: dict[str, Any] | Any) -> SessionEntry | None:
        """A stored entry, or None (warned once per platform) when it cannot be loaded."""
        try:
            return SessionEntry.from_dict(data, plugins=self._plugins)
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

    def load(self, session_key: str) -> SessionEntry | None:
        """The entry of a key from the cache or the backend (a stale route counts as none).

        Only the writer thread fills the cache: a reader elsewhere could otherwise put back an
        entry older than one the writer has just cached. On a shared store it also records the
        row's revision, even of a row read as none (the write replacing it expects it)."""
        session_key = clean_text(session_key)  # as a key built from a source would have it
        entry = self._cache.get(session_key)
        if entry is not None:
            return entry
        if self._unmark(session_key):
            return None  # read with the batch's other lanes: no route
        backing = self._backing
        leases, revision = backing.bound.leases, None
        with backing.canonical:
            if leases is None:
                data = backing.backend.get_route(session_key)
            else:
                data, revision = leases.read_route(session_key) or (None, None)
            entry = ended = None
            if data is not None:
                entry, ended = self.parse(data), data.get(SESSION_ENDED)
            if entry is not None and ended is None:  # not told with the entry: read its session
                row = backing.backend.get_session(entry.session_id)
                ended = row is not None and row.end_reason is not None
        if ended:
            entry = None  # stale route: its session ended at a boundary elsewhere
        if self._writer.on_writer_thread:
            self.cache(session_key, entry, revision)
        return entry

    def current_entry_of(self, session_id: str) -> SessionEntry | None:
        """The cached (newest) entry whose current session id is ``session_id``, or None."""
        with self._backing.canonical:
            data = self._backing.backend.get_route_by_session_id(session_id)
        entry = self.parse(data) if data is not None else None
        if entry is None:
            return None
        cached = self.load(entry.session_key)
        return cached if cached is not None else entry

    @contextmanager
    def prefetched(self, session_keys: list[str]) -> Iterator[None]:
        """Within it (a writer batch whose steps change the lanes ``session_keys``), the routes
        of those lanes the cache lacks are read, in one backend read on entering, rather than
        one statement each on the writer's serial path: the entries found are cached, and the
        first :meth:`load` of a key found without a live route answers None without reading.

        Only on a single-instance store whose backend declares ``route_batches`` (a shared
        store's lease grant reads a cold lane's route in its own statement already)."""
        bound = self._backing.bound
        batches = bound.batches if bound.leases is None else None
        keys = {clean_text(key) for key in session_keys} if batches is not None else ()
        missing = [key for key in keys if not self._cache.holds(key)]
        if batches is None or not missing:
            yield
            return
        with self._backing.canonical:
            found = batches.get_routes(missing)
        self._batch.absent = absent = set(missing)
        for key, data in found.items():
            ended = data.get(SESSION_ENDED)
            entry = None if ended else self.parse(data)
            if ended is None or entry is not None:
                absent.discard(key)  # not told whether it ended: read as usual
            if ended is False and entry is not None:
                self.cache(key, entry, None)
        try:
            yield
        finally:
            self._batch.absent = None

    def _unmark(self, session_key: str) -> bool:
        """Whether the open batch of the calling thread read ``session_key`` without a live
        route, with no load or write of it since; either way it is unmarked now."""
        absent: set[str] | None = getattr(self._batch, "absent", None)
        if not absent or session_key not in absent:
            return False
        absent.discard(session_key)
        return True

    @staticmethod
    def snapshot(entry: SessionEntry) -> SessionEntry:
        """A copy for callers, so the cached entry never changes under them (or by them)."""
        metadata = copy.deepcopy(entry.metadata) if entry.metadata else {}
        return changed(entry, {"metadata": metadata})

    # -- lookups -----------------------------------------------------------------------------------

    def lookup_by_session_key(self, session_key: str) -> SessionEntry | None:
        """The lane's entry (read-only: never creates or touches); falsy key → None."""
        entry = self.load(session_key) if session_key else None
        return self.snapshot(entry) if entry is not None else None

    def peek_session_id(self, session_key: str) -> str | None:
        """The lane's current session id, or None."""
        entry = self.load(session_key) if session_key else None
        return entry.session_id if entry is not None else None

    def lookup_by_session_id(self, session_id: str) -> SessionEntry | None:
        """The entry whose *current* session id is ``session_id``, or None."""
        if not isinstance(session_id, str) or session_id_problem(session_id) is not None:
            return None  # no session has such an id
        entry = self.current_entry_of(session_id)
        return self.snapshot(entry) if entry is not None else None

    def list_sessions(
        self, active_minutes: float | None = None, *, resume_pending: bool = False
    ) -> list[SessionEntry]:
        """All loadable entries (or those updated within ``active_minutes``; only those marked
        ``resume_pending`` if so asked, read through the backend's narrow query), newest
        first."""
        backend = self._backing.backend
        with self._backing.canonical:
            stored = backend.routes_to_resume() if resume_pending else list(backend.iter_routes())
        entries = [entry for entry in map(self.parse, stored) if entry is not None]
        if active_minutes is not None:
            minutes = checked_span(active_minutes, "active_minutes", "minutes")
            cutoff = utc_now() - timedelta(minutes=minutes)
            entries = [entry for entry in entries if entry.updated_at >= cutoff]
        return sorted(entries, key=lambda entry: entry.updated_at, reverse=True)

    def get_session_metadata(self, session_key: str, name: str, default: Any = None) -> Any:
        """A deep copy of one per-lane metadata value, or ``default``."""
        entry = self.load(session_key) if session_key else None
        if entry is None or name not in entry.metadata:
            return default
        return copy.deepcopy(entry.metadata[name])

    def session_row(self, session_id: str) -> SessionRow | None:
        """The stored row of a session (start, end, counters, last activity), or None."""
        with self._backing.canonical:
            return self._backing.backend.get_session(session_id)

    def has_any_sessions(self) -> bool:
        """True iff at least two session rows exist (the caller's own counts as one)."""
        with self._backing.canonical:
            return self._backing.backend.count_sessions() >= 2

    # -- the cache ---------------------------------------------------------------------------------

    def cache(self, session_key: str, entry: SessionEntry | None, revision: int | None) -> None:
        """Cache the key's entry as read or written at ``revision`` (see
        :meth:`EntryCache.put`)."""
        shared = self._backing.bound.leases is not None
        self._unmark(session_key)  # written since its batch read it
        self._cache.put(session_key, entry, revision, shared=shared)

    def remember(self, entry: SessionEntry, revision: int | None = None) -> None:
        """Cache ``entry`` as just written (at ``revision`` on a shared store)."""
        self.cache(entry.session_key, entry, revision)

    def forget(self, session_key: str) -> None:
        """Drop the key's cached entry: the next use reads its row."""
        self._unmark(session_key)
        self._cache.forget(session_key)

    def cached_revision(self, session_key: str) -> int | None:
        """The revision of the key's cached entry (None: no entry cached, or not known)."""
        return self._cache.cached_revision(session_key)

    def bumped(self, session_key: str) -> int | None:
        """The key's row revision after one more (unchecked) write by this process."""
        revision = self._cache.revision(session_key)
        return None if revision is None else revision + 1

    def changed(self) -> None:
        """Count a change of the routing index (the mirror follows it)."""
        self._cache.routing_changed()

    # -- writes ------------------------------------------------------------------------------------

    def write_entry(self, entry: SessionEntry, write: Callable[[], object]) -> None:
        """Write ``entry``'s routing row with ``write`` (one backend method), then cache it.

        On a shared store the row is written only while it has the revision this process last
        read or wrote (none: only while the key has no row); otherwise nothing of ``write`` is
        written, the key's cached entry is dropped and :class:`RoutingConflictError` raised."""
        key = entry.session_key
        rows = self._backing.bound.leases
        revision = None
        with self._backing.canonical:
            if rows is None:
                write()
            else:
                with rows.checked_routes({key: self._cache.revision(key)}) as written:
                    write()
                revision = written.get(key)
        if rows is not None and revision is None:
            self.forget(key)
            raise RoutingConflictError(
                f"the routing entry of {key} was changed by another gateway process after this "
                "one read it, on every attempt; nothing was written. Try again: the change then "
                "applies to the entry as it is now."
            )
        self.changed()
        self.remember(entry, revision)

    def persist(self, entry: SessionEntry, *, touch: bool = False) -> None:
        """Write one routing entry (checked, see :meth:`write_entry`), then cache it."""
        backing = self._backing
        self.write_entry(entry, lambda: backing.backend.put_route(entry.to_dict(), touch=touch))

    def write_all(self, entries: list[SessionEntry]) -> None:
        """Persist several entries in one transaction (unchecked), then cache them."""
        if not entries:
            return
        with self._backing.canonical:
            self._backing.backend.put_routes([entry.to_dict() for entry in entries])
        self.changed()
        for entry in entries:
            self.remember(entry)

    def redo(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, which reads a lane's entry, changes it and writes it with
        :meth:`write_entry`; after a conflict, again from the row as it is now (at most
        :data:`ROUTING_ATTEMPTS` times in all)."""
        for _ in range(ROUTING_ATTEMPTS - 1):
            try:
                return attempt()
            except RoutingConflictError:
                logger.debug("a routing entry changed in another process; redoing the write")
        return attempt()

    def notify(self, kind: LifecycleKind, entry: SessionEntry, **detail: Any) -> None:
        """Tell observers, once the change is committed."""
        if self._plugins.observing:
            event = LifecycleEvent(
                kind=kind, session_key=entry.session_key, session_id=entry.session_id, detail=detail
            )
            self._writer.after_commit(functools.partial(self._plugins.notify, event))
