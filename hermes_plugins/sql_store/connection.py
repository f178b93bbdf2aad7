"""The connection of a SQL store: its dialect, engine, writer connections, schema and index.

A store opens in this order: the dialect of its URL, the engine, the one-writer lock (SQLite's
lock file; PostgreSQL's is held by the writer connections, see ``writers``), the first writer
connection, then the schema created or upgraded (``upgrade``; a store opened read-only only
checks it, holds no lock and refuses every write) and the state of the full-text index read.

Reads use pooled connections so they never wait for a writer. Each write method of the
backend's parts is one transaction committed before it returns, unless it runs inside
:meth:`SqlConnection.transaction`, where the store's writer groups many steps into one commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, make_url, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError, HermesError, StoreError
from hermes_core.state.instance import LockFile
from hermes_plugins.sql_store.dialects import dialect_for
from hermes_plugins.sql_store.schema import state_meta
from hermes_plugins.sql_store.statements import Prepared, Statements
from hermes_plugins.sql_store.upgrade import check_schema, migrate
from hermes_plugins.sql_store.writers import WriterConnections, store_error
from hermes_plugins.sql_store.writes import CountingCursor, Transaction, Write


def display_url(url: URL) -> str:
    """The URL without credentials, for messages and logs."""
    return url.set(username=None, password=None).render_as_string(hide_password=True)


class SqlConnection:
    """What every part of the SQL backend reads and writes through: the engine and its
    dialect, the writer connections, the statements compiled for them, and the full-text
    index that follows their commits."""

    def __init__(self, url: str, config: GatewayConfig, *, read_only: bool = False) -> None:
        self.url = make_url(url)
        self.read_only = read_only
        self.display = display_url(self.url)
        self.dialect = dialect_for(self.url.get_backend_name())
        self.shared = config.storage.instances == "shared"
        """Several gateways share the database under turn leases: no writer lock; schema
        changes run under a transaction-level advisory lock instead."""
        if self.shared and not self.dialect.shared_instances:
            raise ConfigError(
                "storage.instances",
                "storage.instances is 'shared', but SQLite allows one writer per database: "
                "remove storage.instances, or move the state to PostgreSQL (hermes-sessions "
                "migrate) and point storage.url at it.",
            )
        writers = config.storage.writers if self.dialect.parallel_writers else 1
        self._reads = 0
        """Read transactions, for benchmarks (the writer connections count the rest)."""
        self._file_lock: LockFile | None = None
        self.engine = self.dialect.create_engine(
            self.url, self.display, config, read_only=read_only,
            pooled=config.storage.read_connections + writers + self.shared,
        )  # fmt: skip
        self.driver_error: type[Exception] = self.engine.dialect.loaded_dbapi.Error
        self.checkpoints = self.dialect.checkpointer(
            self.url, self.display, config, read_only=read_only
        )
        self.writers = WriterConnections(
            self.engine, self.dialect, self.display, writers, read_only=read_only,
            shared_lease=config.storage.turn_lease_secs if self.shared else None,
        )  # fmt: skip
        try:
            if not read_only:  # the lock comes first: only its holder creates or upgrades schema
                self._file_lock = self.dialect.lock_database(self.url, self.display, config)
                self.writers.connect(self.writers.slots[0], first=True)
            with self.engine.connect() as conn:
                self.dialect.secure_files(self.url)
                if read_only:
                    check_schema(conn, self.display)
                else:
                    self.dialect.check_capacity(conn, self.display, writers, config)
                    migrate(conn, self.dialect, self.display, shared=self.shared)
                self.index = self.dialect.search_index(self, conn)
        except (SQLAlchemyError, self.driver_error) as exc:  # a raw connection's are bare
            self._release()
            raise self.translate(exc, "opening the store", unavailable=True) from exc
        except HermesError:
            self._release()
            raise
        self.compiler = self.dialect.compiler(self.engine)
        self.sql = Statements(self.dialect, self.compiler)

    # -- writes -----------------------------------------------------------------------------------

    def transaction(self) -> Transaction:
        """One transaction around several write methods (the store's group commit): the writes
        inside join it and it commits once at the end; nothing is committed if it raises."""
        return Transaction(self)

    def write(self, what: str, *, ddl: bool = False) -> Write:
        """One write transaction on the writer's DBAPI cursor, committed on success (or part of
        the open :meth:`transaction`, which commits it); ``what`` names it in errors.

        Statements are Core, compiled once (``Statements``); executing them on the driver
        directly keeps a one-row transaction close to the cost of raw SQL.
        """
        return Write(self, what, ddl)

    def after_commit(self) -> None:
        """What follows a commit of the writer: the full-text index's catch-up, then the
        checkpoint thread told that the log grew."""
        self.index.after_commit()
        if self.checkpoints is not None:
            self.checkpoints.committed()

    def writer_connections(self) -> int:
        """Writer connections: ``StorageConfig.writers`` where the dialect has parallel
        writers, else 1."""
        return len(self.writers.slots)

    def bind_writer(self, index: int) -> None:
        """Writes of the calling thread go over writer connection ``index`` from now on."""
        self.writers.bind(index)

    @property
    def writer_lock(self) -> threading.RLock:
        """The lock of the calling thread's writer connection (held by every write on it)."""
        return self.writers.slot.lock

    @property
    def in_batch(self) -> bool:
        """Whether the calling thread holds the open :meth:`transaction`: its reads then go
        through the writer's connection, which sees the batch's own writes and costs no pool
        checkout."""
        return self.writers.slot.owner == threading.get_ident()

    def rollback(self) -> None:
        """Roll back the calling thread's writer transaction (see
        ``WriterConnections.rollback``)."""
        self.index.rolled_back()
        self.writers.rollback()

    def commit_apart(self, step: Callable[[CountingCursor], None]) -> None:
        """Run ``step`` on the calling thread's writer cursor in a transaction of its own and
        commit it (the caller holds :attr:`writer_lock`); a driver error rolls it back and is
        raised as it is."""
        writer, cursor = self.writers.live()
        try:
            step(cursor)
            writer.commit()
        except self.driver_error:
            self.rollback()
            raise
        self.writers.slot.counters["commits"] += 1

    def execute(self, cursor: Any, statement: Any) -> Any:
        """Run a rarely used Core statement on the writer cursor (compiled per call)."""
        return Prepared(statement, self.engine.dialect).run(cursor, None)

    def prepare(self, statement: Any) -> Prepared:
        """A statement compiled once, as the store's own are (kept by the caller)."""
        return Prepared(statement, self.compiler)

    def put_meta(self, cursor: Any, name: str, value: str) -> None:
        """Set one ``state_meta`` value on the writer's cursor."""
        self.dialect.put_meta(cursor, self.sql, name, value)

    # -- reads ------------------------------------------------------------------------------------

    @contextmanager
    def read(self, what: str) -> Iterator[Connection]:
        """A pooled read connection (never blocked by the writer)."""
        self._reads += 1
        try:
            with self.engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise self.translate(exc, what) from exc

    def fetch(self, statement: Prepared, params: Mapping[str, Any], what: str) -> list[Any]:
        """Every row of a read in the open batch (on the writer's cursor) as a mapping."""
        try:
            cursor = statement.run(self.writers.live()[1], params)
            rows = cursor.fetchall()
        except self.driver_error as exc:
            self.writers.slot.spoiled = True
            raise self.translate(exc, what) from exc
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in rows]

    def all_rows(self, statement: Prepared, params: Mapping[str, Any], what: str) -> list[Any]:
        """Every row of a read as a mapping: in the writer's open batch on its cursor (it sees
        the batch's writes), else from the pool."""
        if self.in_batch:
            return self.fetch(statement, params, what)
        with self.read(what) as conn:
            return list(conn.exec_driver_sql(statement.sql, statement.bind(params)).mappings())

    def row(self, statement: Prepared, params: dict[str, Any], what: str) -> Any:
        """One row of a read (see :meth:`all_rows`) as a mapping, or None."""
        rows = self.all_rows(statement, params, what)
        return rows[0] if rows else None

    def rows(self, statement: Prepared, what: str) -> list[dict[str, Any]]:
        """Every row of a read from the pool as a dict, fetched on the driver's cursor (without
        SQLAlchemy's row objects: for reads of many rows, such as ``export``'s)."""
        with self.read(what) as conn:
            cursor = conn.connection.cursor()
            try:
                statement.run(cursor)
                names = [column[0] for column in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            except self.driver_error as exc:
                raise self.translate(exc, what) from exc
            finally:
                cursor.close()

    def get_meta(self, name: str) -> str | None:
        """A ``state_meta`` value, or None."""
        with self.read("reading state_meta") as conn:
            value = conn.execute(
                select(state_meta.c.value).where(state_meta.c.key == name)
            ).scalar()
        return None if value is None else str(value)

    def translate(self, exc: Exception, what: str, unavailable: bool = False) -> StoreError:
        """A driver (or SQLAlchemy) error as a store error a user can act on."""
        return store_error(self.display, exc, what, unavailable)

    # -- the store as a whole ---------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``backend``, ``fts`` state and whether writes can be stored now (``available``;
        ``unavailable_reason`` says why not: the connection is lost or another writer took the
        database)."""
        reason = self.writers.unavailable()
        return {
            "backend": self.dialect.name, "fts": self.index.state, "available": reason is None,
            "unavailable_reason": reason,
        }  # fmt: skip

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks: ``commits``, ``statements`` (writer), ``reads``, and
        ``round_trips`` (all three: on PostgreSQL each is one exchange with the server; a read
        also returns its connection to the pool, which SQLAlchemy ends with a rollback)."""
        counters = self.writers.totals()
        counters["reads"] = self._reads
        counters["round_trips"] = counters["commits"] + counters["statements"]
        counters["round_trips"] += 2 * counters["reads"]
        return counters

    def close(self) -> None:
        """Close the writer and every pooled connection, then release the writer lock
        (idempotent)."""
        if self.writers.close():
            self._release()

    def _release(self) -> None:
        """Close the connections (PostgreSQL's writer lock ends with the writers' sessions),
        then let go of SQLite's lock file. The checkpoint thread ends first: the last
        connection to close then checkpoints what is left."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.stop()
            self.writers.release()
        finally:
            self.engine.dispose()
            if self._file_lock is not None:
                self._file_lock.release()
