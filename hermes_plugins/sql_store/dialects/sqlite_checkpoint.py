"""SQLite checkpoints off the writer's path: a thread of the store copies the WAL into the
database after commits, on a connection of its own.

Left to itself, SQLite checkpoints on the committing connection once the WAL holds
``wal_autocheckpoint`` pages: the writer then reads every page written since the last one back
from the WAL, writes it into the database file and syncs both, inside the commit of whichever
turn crossed the line, while every other turn waits. How many pages that is grows with the
store: a turn on a lane of a store of a million writes its rows into leaf pages no other turn
shares, where a small store's turns rewrite the same few pages. Measured at 1,000,000 lanes,
the writer spent a third of its time on checkpoints (see docs/benchmarks.md).

So the :class:`Checkpointer` thread runs SQLite's ``PASSIVE`` checkpoint (it copies what no
reader still needs and never blocks the writer) at most every :data:`CHECKPOINT_EVERY_SECS`
while commits come, and the SQLite calls that do the copying let other Python threads run. A
commit is as durable as before: a checkpoint only moves committed pages, and one killed midway
is finished by the next. The writer's own automatic checkpoint stays as a backstop at
:data:`WRITER_CHECKPOINT_PAGES`, should the thread fall behind or fail.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

CHECKPOINT_EVERY_SECS = 0.2
"""The longest a checkpoint waits after the commit that called for it: the commits of that
time are copied together (a page rewritten by several is copied once)."""
WRITER_CHECKPOINT_PAGES = 10_000
"""``wal_autocheckpoint`` of the writer connection: past this many WAL pages (40 MB at 4 KiB)
the writer checkpoints itself, as SQLite does by default at 1,000."""


class Checkpointer:
    """The store's checkpoint thread, started at the first commit and stopped before the
    store's connections close (the last of them then checkpoints what is left and removes the
    WAL, as SQLite does)."""

    def __init__(self, database: Path, synchronous: str, busy_secs: float, display: str) -> None:
        self._database = database
        self._synchronous = synchronous
        """The checkpoint syncs the files as the writer's setting says (``NORMAL`` or ``FULL``:
        the WAL before copying, the database after; ``OFF``: never)."""
        self._busy_secs = busy_secs
        self._display = display
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        self._warned = False

    def committed(self) -> None:
        """A commit put pages in the WAL: copy them within :data:`CHECKPOINT_EVERY_SECS`."""
        if self._thread is None:
            self._start()
        self._due.set()

    def _start(self) -> None:
        with self._starting:
            if self._thread is None and not self._stopping.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="hermes-sqlite-checkpoint", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        """End the thread (idempotent); the checkpoint under way, if any, finishes first."""
        with self._starting:
            self._stopping.set()
            thread = self._thread
        self._due.set()
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._database, timeout=self._busy_secs, isolation_level=None)
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
        except sqlite3.Error as exc:
            self._failed(exc)
            return
        try:
            while True:
                self._due.wait()
                if self._stopping.is_set():
                    return
                # Cleared before the wait, never after: a commit or a stop that sets it from
                # here on is seen at the next turn of the loop (cleared after, a stop that came
                # during the wait was lost, and ``stop`` joined this thread for good).
                self._due.clear()
                if self._stopping.wait(CHECKPOINT_EVERY_SECS):
                    return
                self._checkpoint(conn)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """Copy what the WAL holds past the last checkpoint and no reader still needs."""
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            self._failed(exc)

    def _failed(self, exc: sqlite3.Error) -> None:
        """Warn once: the writer's own checkpoints still bound the WAL."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: a background checkpoint failed (%s); the writer checkpoints the WAL itself "
                "past %d pages",
                self._display, exc, WRITER_CHECKPOINT_PAGES,
            )  # fmt: skip
