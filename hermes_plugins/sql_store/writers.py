"""The writer connections of a SQL store: one per writer thread, each holding the writer lock.

Writes go over writer connections: one on SQLite (it has one writer anyway), on PostgreSQL
``StorageConfig.writers`` (``storage.writer_connections``; unset, 2, or 1 when shared), one per
writer thread of the store (:meth:`WriterConnections.bind`; threads never bound share the
first). A connection is opened at first use and then holds the database's one-writer lock as
its dialect takes it (on PostgreSQL every writer connection holds it, shared among them; none
does on a shared store). When a connection is lost (PostgreSQL) its writes are refused; it
reconnects at its next write (at most once per back-off interval) and takes the lock again
before writing; if another process took the lock meanwhile, the store writes nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection

from hermes_core.domain.errors import (
    CorruptDatabaseError,
    GatewayLockedError,
    ReadOnlyStoreError,
    StoreError,
    StoreUnavailableError,
)
from hermes_plugins.sql_store.writes import CountingCursor

if TYPE_CHECKING:
    from hermes_plugins.sql_store.dialects import Dialect

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_SECS = (0.5, 30.0)
"""After a failed reconnect the next waits this long, doubling each time up to the bound."""


def store_error(display: str, exc: Exception, what: str, unavailable: bool = False) -> StoreError:
    """A driver (or SQLAlchemy) error as a store error a user can act on."""
    text = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or ["unknown"])[0]
    lowered = text.lower()
    if "not a database" in lowered or "malformed" in lowered:
        return CorruptDatabaseError(
            f"{display}: {what} failed because the database is corrupt ({text}); stop "
            "the gateway and run `hermes-sessions doctor` for the repair procedure."
        )
    if unavailable or isinstance(exc, OperationalError) or "Operational" in type(exc).__name__:
        return StoreUnavailableError(f"{display}: {what} failed: {text}")
    return StoreError(f"{display}: {what} failed: {text}")


class Slot:
    """One writer connection and the transaction open on it (used by one thread at a time)."""

    __slots__ = (
        "backend_pid", "counters", "cursor", "depth", "lock", "lost", "owner", "spoiled", "writer",
    )  # fmt: skip

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.writer: PoolProxiedConnection | None = None
        """None until first used, while read-only, or after a loss (see ``live``)."""
        self.cursor: CountingCursor | None = None
        self.backend_pid: int | None = None
        """The server process of the connection, where there is one (to tell our lock
        holders apart)."""
        self.lost = False
        """The connection was found lost and is not open again yet."""
        self.depth = 0
        """Nesting of :meth:`SqlConnection.transaction` (0: none open)."""
        self.owner: int | None = None
        """The thread holding the open transaction."""
        self.spoiled = False
        self.counters = {"commits": 0, "statements": 0}


class _Bound(threading.local):
    """Per thread: the writer connection its writes go over (``slot`` starts as the first in
    every thread, so reading it never misses: a missed thread-local lookup costs an error)."""

    def __init__(self, first: Slot) -> None:
        self.slot = first


class WriterConnections:
    """The writer connections of one store and what their losses left: a back-off, a fence."""

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        display: str,
        count: int,
        *,
        read_only: bool,
        shared_lease: float | None,
    ) -> None:
        """``shared_lease``: a shared store's turn lease, in seconds (its connections hold no
        writer lock); None: not shared."""
        self._engine = engine
        self._dialect = dialect
        self._display = display
        self._read_only = read_only
        self._shared_lease = shared_lease
        self._driver_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self.slots = [Slot() for _ in range(count)]
        self._bound = _Bound(self.slots[0])
        self._connecting = threading.Lock()
        """Connections are opened one at a time: each checks the lock's holders."""
        self._closed = False
        self.lost_at: float | None = None
        """When the first connection still lost was found lost."""
        self._retry_at = 0.0
        self._backoff = 0.0
        self.fenced: StoreUnavailableError | None = None
        """Set for good when another writer took the database while a connection was lost."""

    def bind(self, index: int) -> None:
        """Writes of the calling thread go over writer connection ``index`` from now on."""
        self._bound.slot = self.slots[index]

    @property
    def slot(self) -> Slot:
        """The calling thread's writer connection (the first unless it was bound)."""
        return self._bound.slot

    def live(self) -> tuple[PoolProxiedConnection, CountingCursor]:
        """The calling thread's writer connection and cursor; opened at first use, and after a
        loss a new connection that has taken the writer lock again (one attempt per back-off
        interval, else the write is refused)."""
        slot = self._bound.slot
        if slot.writer is not None and slot.cursor is not None:
            return slot.writer, slot.cursor
        if self._read_only:
            raise ReadOnlyStoreError(
                f"{self._display}: this store was opened read-only and changes nothing; open it "
                "for writing (one writer per database at a time) to change it."
            )
        self._reopen(slot)
        self.revive()
        return self.live()

    def _reopen(self, slot: Slot) -> None:
        """Open ``slot``'s connection (first use, or after a loss), or raise: refused within
        the back-off interval after a failed attempt, fenced for good if another process
        took the writer lock meanwhile."""
        if self.fenced is not None:
            raise self.fenced
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnavailableError(
                f"{self._display}: the connection to the database is lost; nothing was written "
                f"(the next reconnect is in {self._retry_at - now:.1f} s)."
            )
        try:
            self.connect(slot)
        except GatewayLockedError as exc:
            self.fenced = StoreUnavailableError(
                f"{self._display}: the writer lock was taken by another process while this "
                f"store's connection was lost ({exc}); this store writes nothing more: stop one "
                "of the two, then restart this one."
            )
            logger.error("%s", self.fenced)
            raise self.fenced from exc
        except (SQLAlchemyError, self._driver_error) as exc:
            first, bound = RECONNECT_BACKOFF_SECS
            self._backoff = min(max(2 * self._backoff, first), bound)
            self._retry_at = now + self._backoff
            raise store_error(
                self._display, exc, "reconnecting to the database", unavailable=True
            ) from exc
        slot.lost = False
        self._backoff, self._retry_at = 0.0, 0.0
        if self.lost_at is not None and not any(other.lost for other in self.slots):
            logger.warning(
                "%s: the connection to the database is back after %.1f s; writes work again",
                self._display, now - self.lost_at,
            )  # fmt: skip
            self.lost_at = None

    def revive(self) -> None:
        """Reopen the other writer connections found lost, so the store is whole again (and
        ``health`` says so) even while their threads have nothing to write; a connection in
        use by its thread is left to it."""
        for other in self.slots:
            if not other.lost or not other.lock.acquire(blocking=False):
                continue
            try:
                if other.lost:
                    self._reopen(other)
            except StoreError:
                logger.debug("reopening another writer connection failed", exc_info=True)
                return
            finally:
                other.lock.release()

    def connect(self, slot: Slot, *, first: bool = False) -> None:
        """Open a writer connection, ready to write as its dialect makes it (see
        ``Dialect.prepare_writer``). ``first``: the store's first connection, which proves
        that no other process writes; every later one (another writer thread's, or one
        replacing a lost connection) joins the lock and checks that it shares it only with
        this store's own connections."""
        with self._connecting:
            writer = self._engine.raw_connection()
            try:
                ours = {other.backend_pid for other in self.slots if other.backend_pid is not None}
                backend_pid = self._dialect.prepare_writer(
                    writer, self._display, first=first, ours=ours, shared_lease=self._shared_lease
                )
            except BaseException:
                writer.close()
                raise
            slot.writer, slot.backend_pid = writer, backend_pid
            slot.cursor = CountingCursor(writer.cursor(), slot.counters)

    def rollback(self) -> None:
        """Roll back the calling thread's transaction; a connection found lost is dropped
        (with it PostgreSQL's writer lock), so the next write reconnects."""
        slot = self._bound.slot
        writer = slot.writer
        if writer is None:
            return
        try:
            writer.rollback()
        except self._driver_error as exc:
            lost = self._engine.dialect.is_disconnect(cast(Any, exc), writer, None)
            if not lost:
                logger.debug("rollback after a failed write also failed", exc_info=True)
                return
            writer.invalidate(exc)
            slot.writer = slot.cursor = slot.backend_pid = None
            slot.lost = True
            if self.lost_at is None:
                self.lost_at = time.monotonic()
            logger.warning(
                "%s: the connection to the database was lost (%s); writes are refused until it "
                "is back", self._display, type(exc).__name__,
            )  # fmt: skip

    def close(self) -> bool:
        """Mark the connections closed, after one being opened now; False if they were."""
        with self._connecting:
            if self._closed:
                return False
            self._closed = True
        return True

    def release(self) -> None:
        """Close every writer connection, each giving up its hold of the writer lock first
        (the server ends a closed session's locks only once its process notices)."""
        for slot in self.slots:
            with slot.lock:
                writer, cursor = slot.writer, slot.cursor
                slot.writer = slot.cursor = slot.backend_pid = None
                if writer is None or cursor is None:
                    continue
                if self._shared_lease is None:
                    try:
                        self._dialect.unlock_writer(writer, cursor)
                    except self._driver_error:
                        logger.debug(
                            "releasing the writer lock failed; it ends with the session",
                            exc_info=True,
                        )
                cursor.close()
                writer.close()

    def unavailable(self) -> str | None:
        """Why writes cannot be stored now (the connection is lost, or another writer took
        the database), or None."""
        if self.fenced is not None:
            return str(self.fenced)
        if self.lost_at is not None:
            return f"{self._display}: the connection to the database is lost; reconnecting"
        return None

    def totals(self) -> dict[str, int]:
        """Commits and statements over every writer connection."""
        return {
            name: sum(slot.counters[name] for slot in self.slots)
            for name in ("commits", "statements")
        }
