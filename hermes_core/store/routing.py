"""Routing writes from the entry cache, checked on a store shared by several gateway processes
(optimistic concurrency on the routing row's ``revision``).

The store caches routing entries (``base``); on a shared store another process may write a
lane's row after this one cached or read it, and a write from the stale copy would undo that
write (a ``/new`` made elsewhere, a turn's marker, a suspension). Every write of a row
increments its ``revision``; the cache keeps the revision each row was read or written at, and
a write of an entry changed from it (a touch, a flag, metadata, counters, a new, reset or
reopened session) applies only while the row still has that revision, a new key's only while
it has no row (:meth:`RoutingStore._write_entry`). Otherwise the backend writes nothing, the
stale copy is dropped and :class:`~hermes_core.domain.errors.RoutingConflictError` is raised.

Each such operation of the store is a function of the lane's current entry, so the store redoes
it on the row as it is now (:meth:`RoutingStore._redo`): what it does then is what it would
have done had it come after the other process's write. A touch, a flag or a metadata value is
applied to the current entry; counters are added to the lane's current session (as in one
process after a reset); a first session the other process created is taken as the lane's; a
reset ends the session the other process's reset started. Only when the row changes again on
every one of :data:`ROUTING_ATTEMPTS` attempts does the error reach the caller, nothing written.

A turn's marker writes (its start, its reply and its end) change only the marker columns and
the activity time, under the lane's lease and its fence: they are not checked, and the cached
revision moves on by one with each (:meth:`RoutingStore._bumped`), so another process's write in
between still shows at the next checked write, and at the next lease taken (``leases``), which
keeps a lane's cached entry only while the row's revision is the cached one (otherwise it caches
the entry read by the grant's own statement). Recovery's writes of the lanes it holds, read just
before, are not checked either and leave those lanes uncached. A single-instance store
checks nothing and keeps no revision: no statement more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from hermes_core.domain.errors import RoutingConflictError
from hermes_core.domain.models import SessionEntry
from hermes_core.store.base import StoreBase

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ROUTING_ATTEMPTS = 3
"""Attempts of one operation whose checked routing write finds the row changed each time."""


class RoutingStore(StoreBase):
    """Routing writes from cached entries, checked on a shared store."""

    def _revision(self, session_key: str) -> int | None:
        """The key's row revision as this process last read or wrote it (None: no row, or
        not known)."""
        with self._map_lock:
            return self._revisions.get(session_key)

    def _cached_revision(self, session_key: str) -> int | None:
        """The revision of the key's cached entry (None: no entry cached, or not known)."""
        with self._map_lock:
            return self._revisions.get(session_key) if session_key in self._entries else None

    def _bumped(self, session_key: str) -> int | None:
        """The key's row revision after one more (unchecked) write by this process."""
        revision = self._revision(session_key)
        return None if revision is None else revision + 1

    def _write_entry(self, entry: SessionEntry, write: Callable[[], object]) -> None:
        """Write ``entry``'s routing row with ``write`` (one backend method), then cache it.

        On a shared store the row is written only while it has the revision this process last
        read or wrote (none: only while the key has no row); otherwise nothing of ``write`` is
        written, the key's cached entry is dropped and :class:`RoutingConflictError` raised."""
        key = entry.session_key
        rows = self._bound.leases
        revision = None
        with self._canonical():
            if rows is None:
                write()
            else:
                with rows.checked_routes({key: self._revision(key)}) as written:
                    write()
                revision = written.get(key)
        if rows is not None and revision is None:
            self._forget(key)
            raise RoutingConflictError(
                f"the routing entry of {key} was changed by another gateway process after this "
                "one read it, on every attempt; nothing was written. Try again: the change then "
                "applies to the entry as it is now."
            )
        self._routing_changed()
        self._remember(entry, revision)

    def _persist(self, entry: SessionEntry, *, touch: bool = False) -> None:
        """Write one routing entry (checked, see :meth:`_write_entry`), then cache it."""
        self._write_entry(entry, lambda: self._backend.put_route(entry.to_dict(), touch=touch))

    def _redo(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, which reads a lane's entry, changes it and writes it with
        :meth:`_write_entry`; after a conflict, again from the row as it is now (at most
        :data:`ROUTING_ATTEMPTS` times in all)."""
        for _ in range(ROUTING_ATTEMPTS - 1):
            try:
                return attempt()
            except RoutingConflictError:
                logger.debug("a routing entry changed in another process; redoing the write")
        return attempt()
