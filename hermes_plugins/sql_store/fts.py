"""SQLite's full-text index behind a watermark: messages are indexed in bulk, not one by one.

An FTS5 insert per message is most of what a message's commit costs (a new index segment per
commit, then merges). So a message insert does not touch the index: once :data:`INDEX_EVERY` or
more messages wait past the watermark (``state_meta.fts_indexed_through``, the highest message id
the index holds), the writer indexes them in one transaction of its own, right after the commit
that stored them, and moves the watermark in it. A fault of the index then fails only that
transaction: the messages are committed already, and the index is marked stale. Search stays
exact: the messages past the watermark are matched through a private in-memory index of the same
tokenizer (see ``search.py``).

Rows at or below the watermark keep their index entries current through the update and delete
triggers; rows past it have none yet and are indexed as they are when the watermark passes them.
"""

from __future__ import annotations

from typing import Any

from hermes_plugins.sql_store.schema import FTS_WATERMARK, SQLITE_FTS_CATCH_UP

INDEX_EVERY = 256
"""Messages waiting before the writer indexes them (bounds the unindexed tail a search scans)."""
CATCH_UP_MAX = 2_000
"""Messages indexed in one transaction at most: a long backlog (after a rebuild or an import)
is indexed over several transactions, so that the writer's other steps run between them."""


class DeferredIndex:
    """The writer's view of the watermark: what is committed and what waits."""

    def __init__(self, indexed_through: int, newest: int) -> None:
        self.indexed_through = indexed_through
        """The committed watermark."""
        self._newest = newest
        """The highest message id inserted so far, as far as the writer knows (a hint: a
        rolled-back insert may leave it too high; the catch-up reads the real maximum)."""
        self._moved_to: int | None = None

    def inserted(self, message_id: int) -> None:
        """Note a message insert."""
        self._newest = max(self._newest, message_id)

    @property
    def due(self) -> bool:
        """Whether enough messages wait to be indexed."""
        return self._newest - self.indexed_through >= INDEX_EVERY

    def catch_up(self, cursor: Any) -> None:
        """Index the waiting messages (at most :data:`CATCH_UP_MAX` ids past the watermark)
        and move the watermark, in the caller's transaction (committed by the caller, then
        :meth:`committed`)."""
        newest = cursor.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()[0]
        newest = min(newest, self.indexed_through + CATCH_UP_MAX)
        cursor.execute(SQLITE_FTS_CATCH_UP, {"after": self.indexed_through, "upto": newest})
        cursor.execute(
            "UPDATE state_meta SET value = :value WHERE key = :key",
            {"key": FTS_WATERMARK, "value": str(newest)},
        )
        self._moved_to = newest

    def committed(self) -> None:
        """The catch-up's transaction committed: its watermark holds."""
        if self._moved_to is not None:
            self.indexed_through, self._newest = self._moved_to, max(self._newest, self._moved_to)
            self._moved_to = None

    def rolled_back(self) -> None:
        """The catch-up's transaction was rolled back."""
        self._moved_to = None
