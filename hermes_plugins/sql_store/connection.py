"""Connections, transactions, schema upgrades and the derived search index of the SQL store.

Writes go over writer connections: one on SQLite (it has one writer anyway), on PostgreSQL
``StorageConfig.writers`` (``storage.writer_connections``; unset, 2, or 1 when shared), one per
writer thread of the store (:meth:`bind_writer`; threads never bound share the first); reads
use pooled connections so they never wait for a writer.
Each write method is one transaction committed before it returns, unless it runs inside
:meth:`SqlConnection.transaction`, where the store's writer groups many steps into one commit.

A store opened for writing holds the database's one-writer lock (``exclusive``) from before the
schema is created or upgraded until it closes: on PostgreSQL every writer connection holds it
(shared among them). When a writer connection is lost (PostgreSQL) its writes are refused; it
reconnects at its next write (at most once per back-off interval) and takes the lock again
before writing. A store opened read-only holds no lock, never creates or upgrades the schema,
and refuses every write.

One module on purpose: the writer connection, its lock, reconnecting and the schema and index
steps all act on the same connection state; tables' rows are in sibling modules.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from sqlalchemy import (
    Connection,
    Engine,
    create_engine,
    delete,
    event,
    func,
    insert,
    make_url,
    select,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import (
    ConfigError,
    CorruptDatabaseError,
    GatewayLockedError,
    HermesError,
    ReadOnlyStoreError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
)
from hermes_core.state.files import create_private_file, ensure_private_dir
from hermes_core.state.instance import LockFile
from hermes_plugins.sql_store import exclusive
from hermes_plugins.sql_store.fts import DeferredIndex
from hermes_plugins.sql_store.schema import (
    FTS_TRIGGERS,
    FTS_WATERMARK,
    MIGRATIONS,
    SCHEMA_VERSION,
    SQLITE_FTS_TRIGGERS,
    reset_sqlite_fts,
    schema_version,
    sqlite_has_fts5,
    state_meta,
)
from hermes_plugins.sql_store.statements import Prepared, Statements
from hermes_plugins.sql_store.writes import CountingCursor, Transaction, Write

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_SIDECARS = ("-wal", "-shm", "-journal")
SQLITE_CACHE_KIB = 65_536
"""Page cache per SQLite connection, in KiB."""
RECONNECT_BACKOFF_SECS = (0.5, 30.0)
"""After a failed reconnect the next waits this long, doubling each time up to the bound."""
CONNECT_TIMEOUT_SECS = 10
"""How long opening a PostgreSQL connection may take (a reconnect never hangs longer)."""

SESSION_TIMEOUTS = {
    "statement_timeout": "300s", "lock_timeout": "30s",
    "idle_in_transaction_session_timeout": "120s",
}  # fmt: skip
"""Set on every PostgreSQL connection: no statement, lock wait or forgotten transaction holds
a connection (and the rows it locked) for ever."""


_FAILED_REINDEX = (
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE NOT i.indisvalid AND c.relname LIKE 'ix\\_messages\\_search\\_ccnew%%'"
)
"""The invalid copies an interrupted ``REINDEX ... CONCURRENTLY`` of the search index left."""


def shared_writer_timeouts(turn_lease_secs: float) -> dict[str, str]:
    """A shared store's writer sessions (set when each connects): a lock wait, and a transaction
    left open by a process that froze, end after a quarter of a lease (at least a second), so
    a frozen process's locks are gone long before its leases expire and can be taken over."""
    bound = f"{max(1000, int(turn_lease_secs * 250))}ms"
    return {"lock_timeout": bound, "idle_in_transaction_session_timeout": bound}


def display_url(url: URL) -> str:
    """The URL without credentials, for messages and logs."""
    return url.set(username=None, password=None).render_as_string(hide_password=True)


class _Slot:
    """One writer connection and the transaction open on it (used by one thread at a time)."""

    __slots__ = (
        "backend_pid", "counters", "cursor", "depth", "lock", "lost", "owner", "spoiled", "writer",
    )  # fmt: skip

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.writer: PoolProxiedConnection | None = None
        """None until first used, while read-only, or after a loss (see ``_live``)."""
        self.cursor: CountingCursor | None = None
        self.backend_pid: int | None = None
        """PostgreSQL's server process of the connection (to tell our lock holders apart)."""
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

    def __init__(self, first: _Slot) -> None:
        self.slot = first


class SqlConnection:
    """The engine, the writer connections and schema of one SQL store."""

    def __init__(self, url: str, config: GatewayConfig, *, read_only: bool = False) -> None:
        self.url = make_url(url)
        self.read_only = read_only
        self.display = display_url(self.url)
        self.name = "sqlite" if self.url.get_backend_name() == "sqlite" else "postgresql"
        self.shared = config.storage.instances == "shared"
        """Several gateways share the database under turn leases (PostgreSQL only): no writer
        lock; schema changes run under a transaction-level advisory lock instead."""
        self._writer_timeouts = shared_writer_timeouts(config.storage.turn_lease_secs)
        if self.shared and self.name == "sqlite":
            raise ConfigError(
                "storage.instances",
                "storage.instances is 'shared', but SQLite allows one writer per database: "
                "remove storage.instances, or move the state to PostgreSQL (hermes-sessions "
                "migrate) and point storage.url at it.",
            )
        writers = config.storage.writers if self.name == "postgresql" else 1
        self._slots = [_Slot() for _ in range(writers)]
        self._bound = _Bound(self._slots[0])
        self._checks = threading.local()
        """Per thread: the routing revisions its writes expect (``SqlBackend.checked_routes``)."""
        self._connecting = threading.Lock()
        """Writer connections are opened one at a time: each checks the lock's holders."""
        self._reads = 0
        """Read transactions, for benchmarks (the slots count commits and statements)."""
        self._warned_fts = False
        self._index: DeferredIndex | None = None
        """SQLite's full-text watermark while its index is in use (see ``fts.py``)."""
        self._closed = False
        self._file_lock: LockFile | None = None
        self._lost_at: float | None = None
        self._retry_at = 0.0
        self._backoff = 0.0
        self._fenced: StoreUnavailableError | None = None
        """Set for good when another writer took the database while the connection was lost."""
        self._engine = self._create_engine(config)
        self._driver_error: type[Exception] = self._engine.dialect.loaded_dbapi.Error
        try:
            if not read_only:  # the lock comes first: only its holder creates or upgrades schema
                if self.name == "sqlite":
                    self._file_lock = exclusive.lock_sqlite(self.path, self.display, config)
                self._connect_writer(self._slots[0], first=True)
            with self._engine.connect() as conn:
                if self.name == "sqlite":
                    self._tighten_sidecars()
                elif not read_only:
                    self._check_connections(conn, config)
                if read_only:
                    self._check_schema(conn)
                else:
                    self._migrate(conn)
                self._fts = self._fts_state(conn)
                self._index = self._deferred_index(conn)
        except (SQLAlchemyError, self._driver_error) as exc:  # a raw connection's are bare
            self._release()
            raise self._translate(exc, "opening the store", unavailable=True) from exc
        except HermesError:
            self._release()
            raise
        self._dialect = self._engine.dialect
        if self.name == "sqlite":  # named parameters: rows go to the driver as they are, no tuples
            self._dialect = sqlite.dialect(paramstyle="named")
        self._sql = Statements(self._dialect)
        self._obligation_updates: dict[tuple[str, ...], Prepared] = {}

    # -- connections ------------------------------------------------------------------------------

    def _create_engine(self, config: GatewayConfig) -> Engine:
        if self.name != "sqlite":
            settings = {
                "application_name": exclusive.application_name(config),
                "connect_timeout": CONNECT_TIMEOUT_SECS,
            }
            options = [f"-c {name}={value}" for name, value in SESSION_TIMEOUTS.items()]
            if self.read_only:  # the server refuses writes too
                options.append("-c default_transaction_read_only=on")
            settings["options"] = " ".join(options)
            # A plain postgresql:// means psycopg 3 here (SQLAlchemy's default is psycopg2).
            url = self.url.set(drivername="postgresql+psycopg")
            try:
                # The writers' connections (and a shared store's listener) come from the pool
                # too and stay checked out: the readers get the rest.
                size = config.storage.read_connections + len(self._slots) + self.shared
                return create_engine(
                    url, pool_pre_ping=True, connect_args=settings, pool_size=size,
                    max_overflow=0,
                )  # fmt: skip
            except ImportError as exc:  # the driver is imported when the engine is created
                raise StoreUnavailableError(
                    f"{self.display}: the PostgreSQL driver psycopg cannot be imported ({exc}); "
                    "install hermes-sessions[postgres]: pip install 'hermes-sessions[postgres]'."
                ) from exc
        database = self.url.database
        if not database or database == ":memory:":
            raise StoreUnavailableError(
                f"{self.display}: an in-memory SQLite database cannot be shared by the store's "
                "connections; use a file path such as sqlite:////path/to/state.db."
            )
        self.path = Path(database)
        try:
            if not self.read_only:
                ensure_private_dir(self.path.parent)
                create_private_file(self.path, b"")
            info = os.lstat(self.path)
        except FileNotFoundError:
            raise StoreUnavailableError(
                f"{self.display}: there is no database at {self.path}; a store opened for "
                "writing (the gateway) creates it, or point storage.url at an existing one."
            ) from None
        except OSError as exc:
            raise StoreUnavailableError(f"{self.display}: cannot create the file: {exc}") from exc
        if not stat.S_ISREG(info.st_mode):
            raise StoreUnavailableError(
                f"{self.display}: {self.path} is not a regular file (a symlink or device); move "
                "it aside or point storage.url at a regular file."
            )
        busy = config.storage.sqlite_busy_timeout_secs
        engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": busy})
        synchronous = config.storage.sqlite_synchronous.upper()

        @event.listens_for(engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Implicit transactions start with BEGIN IMMEDIATE: a write never upgrades a read lock.
            dbapi_connection.isolation_level = "IMMEDIATE"
            dbapi_connection.execute("PRAGMA foreign_keys=ON")
            dbapi_connection.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            if self.read_only:  # SQLite refuses writes too (the writer chose the journal mode)
                dbapi_connection.execute("PRAGMA query_only=ON")
            else:
                mode = dbapi_connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    logger.warning(
                        "%s: WAL journal refused (mode %s); using it as is", self.display, mode
                    )
            dbapi_connection.execute(f"PRAGMA synchronous={synchronous}")
            # A page cache for stores of many lanes (the default 2 MB thrashes at 100k lanes).
            dbapi_connection.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")

        return engine

    def _check_connections(self, conn: Connection, config: GatewayConfig) -> None:
        """A writable PostgreSQL store needs its writer and its readers within the server's
        ``max_connections``: refused if they can never fit, a warning if not beside the
        connections open now."""
        row = conn.exec_driver_sql(exclusive.CONNECTION_LIMITS).one()
        conn.rollback()
        # Open already: the first writer connection and the one this check reads on.
        warning = exclusive.check_connections(
            self.display, len(self._slots), config.storage.read_connections,
            (row[0], row[1], row[2]), ours=2, listening=self.shared,
        )  # fmt: skip
        if warning is not None:
            logger.warning("%s", warning)

    def _tighten_sidecars(self) -> None:
        """Mode 0600 on SQLite's -wal/-shm/-journal files, by path, after the first connection."""
        for suffix in _SIDECARS:
            sidecar = Path(f"{self.path}{suffix}")
            try:
                info = os.lstat(sidecar)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
                os.chmod(sidecar, 0o600)

    def transaction(self) -> Transaction:
        """One transaction around several write methods (the store's group commit): the writes
        inside join it and it commits once at the end; nothing is committed if it raises."""
        return Transaction(self)

    def writer_connections(self) -> int:
        """Writer connections: ``StorageConfig.writers`` on PostgreSQL, 1 on SQLite."""
        return len(self._slots)

    def bind_writer(self, index: int) -> None:
        """Writes of the calling thread go over writer connection ``index`` from now on."""
        self._bound.slot = self._slots[index]

    @property
    def _slot(self) -> _Slot:
        """The calling thread's writer connection (the first unless it was bound)."""
        return self._bound.slot

    @property
    def _in_batch(self) -> bool:
        """Whether the calling thread holds the open :meth:`transaction`: its reads then go
        through the writer's connection, which sees the batch's own writes and costs no pool
        checkout."""
        return self._slot.owner == threading.get_ident()

    def _fetch(self, statement: Prepared, params: Mapping[str, Any], what: str) -> Any:
        """One row of a read in the open batch (on the writer's cursor) as a mapping, or
        None."""
        try:
            cursor = statement.run(self._live()[1], params)
            row = cursor.fetchone()
        except self._driver_error as exc:
            self._slot.spoiled = True
            raise self._translate(exc, what) from exc
        if row is None:
            return None
        return dict(zip([column[0] for column in cursor.description], row, strict=True))

    @property
    def _batched(self) -> bool:
        """Whether writes now join an open :meth:`transaction` (on the thread holding it)."""
        return self._slot.depth > 0

    def _rollback(self) -> None:
        """Roll back the writer's transaction; a connection found lost is dropped (with it
        PostgreSQL's writer lock), so the next write reconnects."""
        if self._index is not None:
            self._index.rolled_back()
        slot = self._slot
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
            if self._lost_at is None:
                self._lost_at = time.monotonic()
            logger.warning(
                "%s: the connection to the database was lost (%s); writes are refused until it "
                "is back", self.display, type(exc).__name__,
            )  # fmt: skip

    def _live(self) -> tuple[PoolProxiedConnection, CountingCursor]:
        """The calling thread's writer connection and cursor; opened at first use, and after a
        loss a new connection that has taken the writer lock again (one attempt per back-off
        interval, else the write is refused)."""
        slot = self._slot
        if slot.writer is not None and slot.cursor is not None:
            return slot.writer, slot.cursor
        if self.read_only:
            raise ReadOnlyStoreError(
                f"{self.display}: this store was opened read-only and changes nothing; open it "
                "for writing (one writer per database at a time) to change it."
            )
        self._reopen(slot)
        self._revive()
        return self._live()

    def _reopen(self, slot: _Slot) -> None:
        """Open ``slot``'s connection (first use, or after a loss), or raise: refused within
        the back-off interval after a failed attempt, fenced for good if another process
        took the writer lock meanwhile."""
        if self._fenced is not None:
            raise self._fenced
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnavailableError(
                f"{self.display}: the connection to the database is lost; nothing was written "
                f"(the next reconnect is in {self._retry_at - now:.1f} s)."
            )
        try:
            self._connect_writer(slot)
        except GatewayLockedError as exc:
            self._fenced = StoreUnavailableError(
                f"{self.display}: the writer lock was taken by another process while this "
                f"store's connection was lost ({exc}); this store writes nothing more: stop one "
                "of the two, then restart this one."
            )
            logger.error("%s", self._fenced)
            raise self._fenced from exc
        except (SQLAlchemyError, self._driver_error) as exc:
            first, bound = RECONNECT_BACKOFF_SECS
            self._backoff = min(max(2 * self._backoff, first), bound)
            self._retry_at = now + self._backoff
            raise self._translate(exc, "reconnecting to the database", unavailable=True) from exc
        slot.lost = False
        self._backoff, self._retry_at = 0.0, 0.0
        if self._lost_at is not None and not any(other.lost for other in self._slots):
            logger.warning(
                "%s: the connection to the database is back after %.1f s; writes work again",
                self.display, now - self._lost_at,
            )  # fmt: skip
            self._lost_at = None

    def _revive(self) -> None:
        """Reopen the other writer connections found lost, so the store is whole again (and
        ``health`` says so) even while their threads have nothing to write; a connection in
        use by its thread is left to it."""
        for other in self._slots:
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

    def _connect_writer(self, slot: _Slot, *, first: bool = False) -> None:
        """Open a writer connection; on PostgreSQL (one writer per database) it holds the
        writer lock before it is used. ``first``: the store's first connection, which proves
        that no other process writes; every later one (another writer thread's, or one
        replacing a lost connection) joins the lock and checks that it shares it only with
        this store's own connections."""
        with self._connecting:
            writer = self._engine.raw_connection()
            try:
                backend_pid = None
                if self.name == "postgresql":
                    cursor = writer.cursor()
                    try:
                        backend_pid = int(cursor.execute("SELECT pg_backend_pid()").fetchone()[0])
                        if self.shared:
                            for name, value in self._writer_timeouts.items():
                                cursor.execute(f"SET {name} = '{value}'")
                        else:
                            ours = {
                                slot.backend_pid
                                for slot in self._slots
                                if slot.backend_pid is not None
                            }
                            exclusive.lock_postgres(
                                cursor, self.display, first=first, ours=ours | {backend_pid}
                            )
                    finally:
                        cursor.close()
                    writer.commit()
            except BaseException:
                writer.close()
                raise
            slot.writer, slot.backend_pid = writer, backend_pid
            slot.cursor = CountingCursor(writer.cursor(), slot.counters)

    def _write(self, what: str, *, ddl: bool = False) -> Write:
        """One write transaction on the writer's DBAPI cursor, committed on success (or part of
        the open :meth:`transaction`, which commits it); ``what`` names it in errors.

        Statements are Core, compiled once (``Statements``); executing them on the driver
        directly keeps a one-row transaction close to the cost of raw SQL.
        """
        return Write(self, what, ddl)

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        """A pooled read connection (never blocked by the writer)."""
        self._reads += 1
        try:
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self._translate(exc, what) from exc

    def _translate(self, exc: Exception, what: str, unavailable: bool = False) -> StoreError:
        """A driver (or SQLAlchemy) error as a store error a user can act on."""
        text = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or ["unknown"])[0]
        lowered = text.lower()
        if "not a database" in lowered or "malformed" in lowered:
            return CorruptDatabaseError(
                f"{self.display}: {what} failed because the database is corrupt ({text}); stop "
                "the gateway and run `hermes-sessions doctor` for the repair procedure."
            )
        if unavailable or isinstance(exc, OperationalError) or "Operational" in type(exc).__name__:
            return StoreUnavailableError(f"{self.display}: {what} failed: {text}")
        return StoreError(f"{self.display}: {what} failed: {text}")

    def close(self) -> None:
        """Close the writer and every pooled connection, then release the writer lock
        (idempotent)."""
        with self._connecting:
            if self._closed:
                return
            self._closed = True
        self._release()

    def _release(self) -> None:
        """Close the connections (PostgreSQL's writer lock ends with the writer's session),
        then let go of SQLite's lock file."""
        try:
            for slot in self._slots:
                with slot.lock:
                    writer, cursor = slot.writer, slot.cursor
                    slot.writer = slot.cursor = slot.backend_pid = None
                    if writer is None or cursor is None:
                        continue
                    if self.name == "postgresql" and not self.shared:
                        self._unlock(writer, cursor)
                    cursor.close()
                    writer.close()
        finally:
            self._engine.dispose()
            if self._file_lock is not None:
                self._file_lock.release()

    def _unlock(self, writer: PoolProxiedConnection, cursor: CountingCursor) -> None:
        """Release PostgreSQL's writer lock before closing: the server ends a closed session's
        locks only once its process notices, and the next writer may be starting already."""
        try:
            writer.rollback()
            cursor.execute(exclusive.UNLOCK_SHARED)
            writer.commit()
        except self._driver_error:
            logger.debug(
                "releasing the writer lock failed; it ends with the session", exc_info=True
            )

    # -- schema ---------------------------------------------------------------------------------

    def _stored_version(self, conn: Connection) -> int:
        """The database's schema version (0: no schema yet); a newer one than this release
        knows is refused."""
        current = 0
        if "schema_version" in set(self._engine.dialect.get_table_names(conn)):
            found = conn.execute(select(func.max(schema_version.c.version))).scalar()
            current = int(found or 0)
        if current > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.display}: the database has schema version {current}, newer than "
                f"version {SCHEMA_VERSION} supported by this hermes-sessions; upgrade "
                "hermes-sessions (the database was left untouched)."
            )
        return current

    def _check_schema(self, conn: Connection) -> None:
        """Read-only: the schema must be there already, at this release's version."""
        current = self._stored_version(conn)
        conn.rollback()
        if current == 0:
            raise StoreUnavailableError(
                f"{self.display}: the database has no hermes-sessions schema yet, so there is "
                "nothing to read; a store opened for writing (the gateway) creates it."
            )
        if current < SCHEMA_VERSION:
            raise StoreUnavailableError(
                f"{self.display}: the database has schema version {current}, older than version "
                f"{SCHEMA_VERSION} of this hermes-sessions; open it for writing once (start the "
                "gateway) to upgrade it, then read it."
            )

    def _migrate(self, conn: Connection) -> None:
        """Create or upgrade the schema in one transaction; refuse a newer schema. Only the
        holder of the writer lock runs this, and it reads the version inside the transaction,
        so processes starting together never create or upgrade the schema twice."""
        if self.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        elif self.shared:  # no writer lock: processes starting together queue up here
            conn.exec_driver_sql(exclusive.MIGRATION_LOCK)
        try:
            current = self._stored_version(conn)
            for step in MIGRATIONS[current:]:
                step(conn)
            if current < SCHEMA_VERSION:
                conn.execute(delete(schema_version))
                conn.execute(insert(schema_version).values(version=SCHEMA_VERSION))
                if current:
                    logger.warning(
                        "%s: upgraded the schema from version %d to %d",
                        self.display, current, SCHEMA_VERSION,
                    )  # fmt: skip
            conn.commit()
        except BaseException:
            conn.rollback()
            raise

    # -- full-text index -------------------------------------------------------------------------

    def _fts_state(self, conn: Connection) -> str:
        if self.name == "sqlite" and not sqlite_has_fts5(conn):
            return "unavailable"
        stale = conn.execute(select(state_meta.c.value).where(state_meta.c.key == "fts_stale"))
        return "stale" if stale.first() is not None else "ok"

    def _deferred_index(self, conn: Connection) -> DeferredIndex | None:
        """SQLite's watermark (see ``fts.py``) when its index is in use; a missing watermark
        marks the index stale (the rebuild sets it)."""
        if self.name != "sqlite" or self._fts != "ok":
            return None
        watermark = conn.execute(
            select(state_meta.c.value).where(state_meta.c.key == FTS_WATERMARK)
        ).scalar()
        if watermark is None:
            self._fts = "stale"
            return None
        newest = conn.exec_driver_sql("SELECT coalesce(max(id), 0) FROM messages").scalar()
        return DeferredIndex(int(watermark), int(newest or 0))

    def _index_behind(self) -> None:
        """After a commit: index the messages waiting past the watermark, when enough wait, in
        a transaction of its own; a fault of the index marks it stale (the messages are stored
        already)."""
        index = self._index
        if index is None or self._fts != "ok" or not index.due:
            return
        writer, cursor = self._live()
        try:
            index.catch_up(cursor)
            writer.commit()
        except self._driver_error as exc:
            self._rollback()
            error = self._translate(exc, "indexing messages for search")
            try:
                self._disable_fts(error)
            except StoreError:
                logger.exception("%s: marking the full-text index stale failed", self.display)
                self._fts, self._index = "stale", None
            return
        self._slot.counters["commits"] += 1
        index.committed()

    def _disable_fts(self, error: StoreError) -> None:
        """Fail open: drop the FTS triggers and mark the index stale (its own transaction)."""
        self._index = None
        with self._write("disabling the full-text index", ddl=True) as cursor:
            for trigger in FTS_TRIGGERS:
                cursor.execute(f"DROP TRIGGER IF EXISTS {trigger}")
            self._set_meta(cursor, "fts_stale", "1")
        self._fts = "stale"
        if not self._warned_fts:
            self._warned_fts = True
            logger.warning(
                "%s: the full-text index is broken (%s); messages are still stored, search uses "
                "a slower scan until the index is rebuilt",
                self.display, error,
            )  # fmt: skip

    def rebuild_fts(self) -> bool:
        """Rebuild the derived index and clear ``fts_stale`` (:meth:`reindex_fts`,
        :meth:`start_fts_rebuild`, then the whole backlog indexed); False when FTS5 is
        unavailable."""
        self.reindex_fts()
        started = self.start_fts_rebuild()
        while started and self.index_backlog():
            pass
        return started

    def reindex_fts(self) -> None:
        """PostgreSQL: rebuild the GIN index with ``REINDEX INDEX CONCURRENTLY`` on a
        connection of its own (no writer's), which blocks neither message writes nor searches;
        an invalid copy a failed run left behind is dropped first. It runs without a statement
        timeout (a large index may take minutes) and waits for the transactions that use the
        old index. SQLite: nothing (:meth:`start_fts_rebuild` and the writer's batches)."""
        if self.name != "postgresql":
            return
        with self._read("rebuilding the full-text index") as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("SET statement_timeout = 0")
            try:
                for name in conn.exec_driver_sql(_FAILED_REINDEX).scalars().all():
                    conn.exec_driver_sql(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
                conn.exec_driver_sql("REINDEX INDEX CONCURRENTLY ix_messages_search")
            finally:
                conn.exec_driver_sql("RESET statement_timeout")

    def start_fts_rebuild(self) -> bool:
        """Start a rebuild of the derived index and clear ``fts_stale``; False when FTS5 is
        unavailable. On SQLite the index is emptied behind a watermark of 0, so that every
        message is indexed later in batches (:meth:`index_backlog`, or after the next commits)
        while search stays exact (see ``fts.py``); PostgreSQL's is rebuilt beforehand, off the
        writer (:meth:`reindex_fts`), and this step only clears the record."""
        if self._fts == "unavailable":
            return False
        newest = 0
        with self._write("rebuilding the full-text index", ddl=True) as cursor:
            if self.name == "sqlite":
                for trigger in FTS_TRIGGERS:
                    cursor.execute(f"DROP TRIGGER IF EXISTS {trigger}")
                reset_sqlite_fts(cursor)
                newest = cursor.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()[0]
                self._set_meta(cursor, FTS_WATERMARK, "0")
                for statement in SQLITE_FTS_TRIGGERS:
                    cursor.execute(statement)
            self._sql.delete_meta.run(cursor, {"key": "fts_stale"})
        self._engine.dispose()  # pooled readers may still hold the broken index's connection
        self._fts = "ok"
        if self.name == "sqlite":
            self._index = DeferredIndex(0, int(newest))
        return True

    def index_backlog(self) -> bool:
        """Index one batch of the messages waiting past the watermark (at most
        ``fts.CATCH_UP_MAX``, in a transaction of its own, as after any commit); True while
        enough wait for another batch."""
        if self._index is None:
            return False
        with self._slot.lock:
            self._index_behind()
        index = self._index
        return index is not None and self._fts == "ok" and index.due

    # -- meta, health -----------------------------------------------------------------------------

    def _set_meta(self, cursor: Any, name: str, value: str) -> None:
        if self.name == "postgresql":  # an upsert: processes starting together may race here
            cursor.execute(
                "INSERT INTO state_meta (key, value) VALUES (%(key)s, %(value)s) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                {"key": name, "value": value},
            )
            return
        self._sql.delete_meta.run(cursor, {"key": name})
        self._sql.insert_meta.run(cursor, {"key": name, "value": value})

    def get_meta(self, name: str) -> str | None:
        """A ``state_meta`` value, or None."""
        with self._read("reading state_meta") as conn:
            value = conn.execute(
                select(state_meta.c.value).where(state_meta.c.key == name)
            ).scalar()
        return None if value is None else str(value)

    def health(self) -> dict[str, Any]:
        """``backend``, ``fts`` state and whether writes can be stored now (``available``;
        ``unavailable_reason`` says why not: the connection is lost or another writer took the
        database)."""
        reason = None
        if self._fenced is not None:
            reason = str(self._fenced)
        elif self._lost_at is not None:
            reason = f"{self.display}: the connection to the database is lost; reconnecting"
        return {
            "backend": self.name, "fts": self._fts, "available": reason is None,
            "unavailable_reason": reason,
        }  # fmt: skip

    def _insert_message(self, cursor: Any, row: Mapping[str, Any]) -> int:
        """Insert one message row on the writer's cursor; its id."""
        self._sql.insert_message.run(cursor, row)
        if self.name != "sqlite":
            return int(cursor.fetchone()[0])
        message_id = int(cursor.lastrowid)
        if self._index is not None:
            self._index.inserted(message_id)
        return message_id  # the session's count follows by trigger (schema version 3)

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks: ``commits``, ``statements`` (writer), ``reads``, and
        ``round_trips`` (all three: on PostgreSQL each is one exchange with the server; a read
        also returns its connection to the pool, which SQLAlchemy ends with a rollback)."""
        counters = {
            name: sum(slot.counters[name] for slot in self._slots)
            for name in ("commits", "statements")
        }
        counters["reads"] = self._reads
        counters["round_trips"] = counters["commits"] + counters["statements"]
        counters["round_trips"] += 2 * counters["reads"]
        return counters

    def _execute(self, cursor: Any, statement: Any) -> Any:
        """Run a rarely used Core statement on the writer cursor (compiled per call)."""
        return Prepared(statement, self._engine.dialect).run(cursor, None)
