"""SQLite's full-text index: FTS5 behind a watermark, so messages are indexed in bulk.

The index is FTS5 external content over a view of the messages (tool output cut to 8 KiB).
An FTS5 insert per message is most of what a message's commit costs (a new index segment per
commit, then merges). So a message insert does not touch the index: once :data:`INDEX_EVERY` or
more messages wait past the watermark (``state_meta.fts_indexed_through``, the highest message id
the index holds), the writer indexes them in one transaction of its own, right after the commit
that stored them, and moves the watermark in it. A fault of the index then fails only that
transaction: the messages are committed already, and the index is marked stale. Search stays
exact: the messages past the watermark are matched through a private in-memory index of the same
tokenizer (see ``sqlite_search``).

Rows at or below the watermark keep their index entries current through the update and delete
triggers; rows past it have none yet and are indexed as they are when the watermark passes them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, insert, select

from hermes_plugins.sql_store.schema import state_meta
from hermes_plugins.sql_store.search import STALE

INDEX_EVERY = 256
"""Messages waiting before the writer indexes them (bounds the unindexed tail a search scans)."""
CATCH_UP_MAX = 2_000
"""Messages indexed in one transaction at most: a long backlog (after a rebuild or an import)
is indexed over several transactions, so that the writer's other steps run between them."""

WATERMARK = "fts_indexed_through"
"""``state_meta`` key: the highest message id the index holds."""

TRIGGERS = ("messages_fts_insert", "messages_fts_delete", "messages_fts_update")
"""Every trigger the index has had (the insert trigger before schema version 4)."""
_PROJECTION = "CASE WHEN {r}.role = 'tool' THEN substr({r}.content, 1, 8192) ELSE {r}.content END"

VIEW = (
    "CREATE VIEW IF NOT EXISTS messages_fts_src AS SELECT id, "
    + _PROJECTION.format(r="messages")
    + " AS content, tool_name, tool_calls FROM messages"
)
TABLE = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5("
    "content, tool_name, tool_calls, content='messages_fts_src', content_rowid='id')"
)
_INSERT = (
    "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls) VALUES "
    "(new.id, " + _PROJECTION.format(r="new") + ", new.tool_name, new.tool_calls);"
)
_DELETE = (
    "INSERT INTO messages_fts(messages_fts, rowid, content, tool_name, tool_calls) VALUES "
    "('delete', old.id, " + _PROJECTION.format(r="old") + ", old.tool_name, old.tool_calls);"
)
_INDEXED = f"old.id <= (SELECT CAST(value AS INTEGER) FROM state_meta WHERE key = '{WATERMARK}')"
FOLLOWING = (
    f"CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages WHEN {_INDEXED} "
    f"BEGIN {_DELETE} END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content, tool_name, "
    "tool_calls, role ON messages WHEN (old.content IS NOT new.content OR old.tool_name IS NOT "
    "new.tool_name OR old.tool_calls IS NOT new.tool_calls OR old.role IS NOT new.role) AND "
    f"{_INDEXED} BEGIN {_DELETE} {_INSERT} END",
)
"""Index entries of rows the index already holds follow their updates and deletes; a message
insert does not touch the index (it is indexed in bulk when the watermark passes it)."""
TAIL_PROJECTION = _PROJECTION.format(r="m")
"""What the index holds of a message ``m`` (tool output cut to 8 KiB)."""
CATCH_UP = (
    "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls) SELECT id, "
    + _PROJECTION.format(r="messages")
    + ", tool_name, tool_calls FROM messages WHERE id > :after AND id <= :upto ORDER BY id"
)
_SETUP = (VIEW, TABLE, "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
"""View, FTS5 table, and a rebuild that indexes the messages already stored."""
_SHADOW_SUFFIXES = ("data", "idx", "docsize", "config")
_TWIN = "hermes_fts_twin"


def has_fts5(conn: Connection) -> bool:
    """Whether this SQLite build has FTS5 (a missing module means ``fts: unavailable``)."""
    options = {row[0] for row in conn.exec_driver_sql("PRAGMA compile_options")}
    return "ENABLE_FTS5" in options


def create(conn: Connection) -> None:
    """Create the FTS5 view, table and triggers (idempotent) and index existing messages."""
    for statement in (*_SETUP, *FOLLOWING):
        conn.exec_driver_sql(statement)


def reset(cursor: Any) -> None:
    """Return the FTS5 index to the state of a freshly created one (on a DBAPI cursor, inside
    the caller's transaction), however damaged its shadow tables are, so ``rebuild`` can run.

    A temporary twin table provides SQLite's own empty shadow rows; the damaged index's shadow
    tables are recreated if missing, emptied and refilled from the twin. Messages are untouched.
    """
    have = {row[0] for row in cursor.execute("SELECT name FROM sqlite_master").fetchall()}
    if "messages_fts" not in have:  # the table itself is gone: clear leftovers and recreate
        for suffix in _SHADOW_SUFFIXES:
            cursor.execute(f"DROP TABLE IF EXISTS messages_fts_{suffix}")
        cursor.execute(VIEW)
        cursor.execute(TABLE)
        return
    cursor.execute(TABLE.replace("IF NOT EXISTS messages_fts", f"temp.{_TWIN}"))
    try:
        for suffix in _SHADOW_SUFFIXES:
            ddl = cursor.execute(
                "SELECT sql FROM sqlite_temp_master WHERE name = ?", (f"{_TWIN}_{suffix}",)
            ).fetchone()[0]
            cursor.execute(
                ddl.replace(
                    f"CREATE TABLE '{_TWIN}_", "CREATE TABLE IF NOT EXISTS main.'messages_fts_"
                )
            )
            cursor.execute(f"DELETE FROM main.messages_fts_{suffix}")
            cursor.execute(
                f"INSERT INTO main.messages_fts_{suffix} SELECT * FROM temp.{_TWIN}_{suffix}"
            )
    finally:
        cursor.execute(f"DROP TABLE IF EXISTS temp.{_TWIN}")


def index_behind_a_watermark(conn: Connection) -> None:
    """Schema version 4: the full-text index no longer follows each insert; it holds the
    messages up to the watermark and the writer indexes the rest in bulk. Every message stored
    so far is indexed (the old insert trigger did it), unless the index is stale, when the
    rebuild sets the watermark. Nothing where this SQLite lacks FTS5."""
    if not has_fts5(conn):
        return
    meta = state_meta.c
    stale = conn.execute(select(meta.value).where(meta.key == STALE)).first() is not None
    for trigger in TRIGGERS:
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {trigger}")
    newest = conn.exec_driver_sql("SELECT coalesce(max(id), 0) FROM messages").scalar()
    conn.execute(delete(state_meta).where(meta.key == WATERMARK))
    conn.execute(insert(state_meta).values(key=WATERMARK, value=str(newest)))
    if not stale:
        for statement in FOLLOWING:
            conn.exec_driver_sql(statement)


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
        cursor.execute(CATCH_UP, {"after": self.indexed_through, "upto": newest})
        cursor.execute(
            "UPDATE state_meta SET value = :value WHERE key = :key",
            {"key": WATERMARK, "value": str(newest)},
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
