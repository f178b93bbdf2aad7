"""The contexts of the SQL store's writer connection: a transaction, one write, and the cursor
that counts statements. Classes rather than generator-based contexts: they run on every write
of every turn, where a generator costs several times as much."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hermes_core.domain.errors import StoreError

if TYPE_CHECKING:
    from hermes_plugins.sql_store.connection import SqlConnection


class Transaction:
    """The context of :meth:`SqlConnection.transaction` (a class, like :class:`Write`). Holds
    the slot's lock throughout; only the outermost of nested ones commits or rolls back."""

    __slots__ = ("_conn", "_slot")

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        writers = self._conn.writers
        slot = self._slot = writers.slot
        slot.lock.acquire()
        try:
            if slot.depth == 0:
                writers.live()  # reconnected before the batch starts, or the batch is refused
                if writers.lost_at is not None:
                    writers.revive()
        except BaseException:
            slot.lock.release()
            raise
        slot.depth += 1
        if slot.depth == 1:
            slot.spoiled = False
            slot.owner = threading.get_ident()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        conn, slot = self._conn, self._slot
        try:
            try:
                if exc is not None:
                    self._failed(exc)
                    return
                if slot.depth == 1:
                    try:
                        if slot.spoiled:
                            raise StoreError(f"{conn.display}: a write of the batch failed")
                        conn.writers.live()[0].commit()
                    except BaseException as error:
                        self._failed(error)
                        raise
                    slot.counters["commits"] += 1
            finally:
                slot.depth -= 1
                if slot.depth == 0:
                    slot.owner = None
            if slot.depth == 0:
                conn.after_commit()
        finally:
            slot.lock.release()

    def _failed(self, exc: BaseException) -> None:
        """After ``exc``: the outermost transaction is rolled back; a driver error is raised as
        a store error."""
        conn = self._conn
        if self._slot.depth == 1:
            conn.rollback()
        if isinstance(exc, conn.driver_error):
            raise conn.translate(exc, "committing") from exc


class Write:
    """The context of :meth:`SqlConnection.write` (a class: a generator-based context costs
    several times as much, on every write). Holds the slot's lock throughout; yields the
    writer's cursor."""

    __slots__ = ("_conn", "_ddl", "_slot", "_what", "_writer")

    def __init__(self, conn: SqlConnection, what: str, ddl: bool) -> None:
        self._conn, self._what, self._ddl = conn, what, ddl

    def __enter__(self) -> CountingCursor:
        conn = self._conn
        slot = self._slot = conn.writers.slot
        slot.lock.acquire()
        try:
            writer, cursor = conn.writers.live()
            self._writer = None if slot.depth > 0 else writer  # None: the open transaction's
            if self._writer is not None and self._ddl:
                try:
                    conn.dialect.begin_ddl(cursor)
                except BaseException as exc:
                    self._failed(exc)
                    raise
        except BaseException:
            slot.lock.release()
            raise
        return cursor

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self._failed(exc)
            elif self._writer is not None:
                try:
                    self._writer.commit()
                except BaseException as error:
                    self._failed(error)
                    raise
                self._slot.counters["commits"] += 1
                self._conn.after_commit()
        finally:
            self._slot.lock.release()

    def _failed(self, exc: BaseException) -> None:
        """After ``exc``: a write of the open transaction spoils it (even if the caller
        swallows the error, the transaction is not to be trusted now); a write of its own is
        rolled back. A driver error is raised as a store error naming the write."""
        conn = self._conn
        if self._writer is None:
            self._slot.spoiled = True
        else:
            conn.rollback()
        if isinstance(exc, conn.driver_error):
            raise conn.translate(exc, self._what) from exc


class CountingCursor:
    """The writer's DBAPI cursor, counting the statements it sends; what every write reads
    back is forwarded explicitly (``__getattr__`` is reached only after a failed lookup)."""

    __slots__ = ("_counters", "_cursor")

    def __init__(self, cursor: Any, counters: dict[str, int]) -> None:
        self._cursor = cursor
        self._counters = counters

    def execute(self, sql: str, params: Any = None) -> Any:
        self._counters["statements"] += 1
        if params is None:
            return self._cursor.execute(sql)
        return self._cursor.execute(sql, params)

    def executemany(self, sql: str, params: Any) -> Any:
        """Counted as one statement: psycopg sends the rows in one pipeline."""
        self._counters["statements"] += 1
        return self._cursor.executemany(sql, params)

    @property
    def rowcount(self) -> int:
        count: int = self._cursor.rowcount
        return count

    @property
    def lastrowid(self) -> Any:
        return self._cursor.lastrowid

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)
