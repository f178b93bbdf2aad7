"""The store's bounded cache of routing entries, and the routing revision the mirror follows.

The routing index is canonical in the backend (one row per key); this is a cache of it, loaded
per key on first use, so opening and memory do not grow with the number of stored sessions. On a
store shared by several gateway processes it also keeps the row revision of each key as last
read or written here (see ``routing``): an entry is cached there only with its revision.
"""

from __future__ import annotations

import threading
from typing import Any

from hermes_core.domain.models import SessionEntry
from hermes_core.domain.recent import Recent


class EntryCache:
    """Session key → routing entry (at most ``size``, least recently used dropped first), the
    keys' row revisions on a shared store, and a counter of routing changes (thread-safe)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: Recent[str, SessionEntry] = Recent(size)
        self._revisions: dict[str, int] = {}
        self._routing_revision = 0

    def get(self, session_key: str) -> SessionEntry | None:
        """The key's cached entry, now the most recently used; None when not cached."""
        with self._lock:
            return self._entries.use(session_key)

    def holds(self, session_key: str) -> bool:
        """Whether the key's entry is cached (its place among the recent is left as it is)."""
        with self._lock:
            return session_key in self._entries

    def put(
        self, session_key: str, entry: SessionEntry | None, revision: int | None, *, shared: bool
    ) -> None:
        """Cache the key's entry (None: nothing to cache); on a ``shared`` store with the
        ``revision`` of the row as read or written (None: no row, or not known; an entry is
        then dropped instead, to be read afresh), kept for as many keys as the cache holds."""
        with self._lock:
            self._revisions.pop(session_key, None)
            if shared and revision is not None:
                self._revisions[session_key] = revision
                if len(self._revisions) > self._size:
                    del self._revisions[next(iter(self._revisions))]
            if entry is None or (shared and revision is None):
                self._entries.pop(session_key, None)
                return
            for dropped in self._entries.put(session_key, entry):
                self._revisions.pop(dropped, None)

    def forget(self, session_key: str) -> None:
        """Drop the key's entry and revision: the next use reads the row."""
        with self._lock:
            self._entries.pop(session_key, None)
            self._revisions.pop(session_key, None)

    def clear(self) -> None:
        """Drop everything cached (after a rolled-back batch, or a switch of backend)."""
        with self._lock:
            self._entries.clear()
            self._revisions.clear()

    def revision(self, session_key: str) -> int | None:
        """The key's row revision as last read or written here (None: no row, or not known)."""
        with self._lock:
            return self._revisions.get(session_key)

    def cached_revision(self, session_key: str) -> int | None:
        """The revision of the key's cached entry (None: no entry cached, or not known)."""
        with self._lock:
            return self._revisions.get(session_key) if session_key in self._entries else None

    def as_dicts(self) -> dict[str, dict[str, Any]]:
        """The cached entries as stored (the newest state of the lanes this process knows)."""
        with self._lock:
            return {key: entry.to_dict() for key, entry in self._entries.items()}

    def routing_changed(self) -> None:
        """Count a change of the routing index (the mirror is rewritten when it moved on)."""
        with self._lock:
            self._routing_revision += 1

    @property
    def routing_revision(self) -> int:
        """Changes of the routing index counted so far."""
        with self._lock:
            return self._routing_revision
