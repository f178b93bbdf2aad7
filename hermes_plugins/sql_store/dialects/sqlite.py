"""SQLite: one file, one writer connection, a lock file beside the database, FTS5 search.

The database is a private file (0600, and so are its ``-wal``/``-shm``/``-journal`` files) in
WAL mode; every write transaction starts with ``BEGIN IMMEDIATE``, so a write never upgrades a
read lock. Statements are compiled with named parameters: a row goes to the driver as it is.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Connection, Engine, Table, event, func
from sqlalchemy import Dialect as Compiler
from sqlalchemy import create_engine as sqlalchemy_engine
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL

from hermes_core.domain.errors import StoreUnavailableError
from hermes_core.state.files import create_private_file, ensure_private_dir
from hermes_plugins.sql_store import exclusive
from hermes_plugins.sql_store.dialects import sqlite_fts
from hermes_plugins.sql_store.dialects.base import Dialect, OnConflictInsert
from hermes_plugins.sql_store.dialects.sqlite_checkpoint import (
    WRITER_CHECKPOINT_PAGES,
    Checkpointer,
)
from hermes_plugins.sql_store.dialects.sqlite_search import Fts5Index

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.state.instance import LockFile
    from hermes_plugins.sql_store.connection import SqlConnection
    from hermes_plugins.sql_store.statements import Statements

logger = logging.getLogger(__name__)

CACHE_KIB = 65_536
"""Page cache per SQLite connection, in KiB."""
_SIDECARS = ("-wal", "-shm", "-journal")
COPYING_META = "copying"
"""The ``state_meta`` key a transaction of ``migrate``'s copy holds from its first statement to
its last (so no other transaction ever sees it), which the message-count trigger checks."""


def database_file(url: URL) -> Path:
    """The database file of a ``sqlite`` URL."""
    return Path(url.database or "")


class SqliteDialect(Dialect):
    """SQLite through the standard library's driver."""

    name = "sqlite"
    parallel_writers = False
    shared_instances = False
    one_round_trip = False
    server_reads = False
    returning_ids = False
    without_rowid = True
    count_trigger = (
        "DROP TRIGGER IF EXISTS messages_count",
        "CREATE TRIGGER messages_count AFTER INSERT ON messages "
        f"WHEN NOT EXISTS (SELECT 1 FROM state_meta WHERE key = '{COPYING_META}') BEGIN "
        "UPDATE sessions SET message_count = message_count + 1, last_activity_at = new.timestamp "
        "WHERE id = new.session_id; END",
    )
    copy_begin = (f"INSERT INTO state_meta (key, value) VALUES ('{COPYING_META}', '1')",)
    copy_end = (f"DELETE FROM state_meta WHERE key = '{COPYING_META}'",)
    after_copy = ()

    def create_engine(
        self, url: URL, display: str, config: GatewayConfig, *, read_only: bool, pooled: int
    ) -> Engine:
        """The engine over the database file, created (0600, in a private directory) unless
        ``read_only``; each connection configured by pragmas."""
        database = url.database
        if not database or database == ":memory:":
            raise StoreUnavailableError(
                f"{display}: an in-memory SQLite database cannot be shared by the store's "
                "connections; use a file path such as sqlite:////path/to/state.db."
            )
        path = Path(database)
        try:
            if not read_only:
                ensure_private_dir(path.parent)
                create_private_file(path, b"")
            info = os.lstat(path)
        except FileNotFoundError:
            raise StoreUnavailableError(
                f"{display}: there is no database at {path}; a store opened for "
                "writing (the gateway) creates it, or point storage.url at an existing one."
            ) from None
        except OSError as exc:
            raise StoreUnavailableError(f"{display}: cannot create the file: {exc}") from exc
        if not stat.S_ISREG(info.st_mode):
            raise StoreUnavailableError(
                f"{display}: {path} is not a regular file (a symlink or device); move "
                "it aside or point storage.url at a regular file."
            )
        busy = config.storage.sqlite_busy_timeout_secs
        engine = sqlalchemy_engine(url, connect_args={"check_same_thread": False, "timeout": busy})
        synchronous = config.storage.sqlite_synchronous.upper()

        @event.listens_for(engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Implicit transactions start with BEGIN IMMEDIATE: a write never upgrades a read lock.
            dbapi_connection.isolation_level = "IMMEDIATE"
            dbapi_connection.execute("PRAGMA foreign_keys=ON")
            dbapi_connection.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            if read_only:  # SQLite refuses writes too (the writer chose the journal mode)
                dbapi_connection.execute("PRAGMA query_only=ON")
            else:
                mode = dbapi_connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    logger.warning(
                        "%s: WAL journal refused (mode %s); using it as is", display, mode
                    )
                # The store's checkpoint thread copies the WAL; this is its backstop.
                dbapi_connection.execute(f"PRAGMA wal_autocheckpoint={WRITER_CHECKPOINT_PAGES}")
            dbapi_connection.execute(f"PRAGMA synchronous={synchronous}")
            # A page cache for stores of many lanes (the default 2 MB thrashes at 100k lanes).
            dbapi_connection.execute(f"PRAGMA cache_size=-{CACHE_KIB}")

        return engine

    def lock_database(self, url: URL, display: str, config: GatewayConfig) -> LockFile:
        """``<database>.lock`` (see ``exclusive``)."""
        return exclusive.lock_sqlite(database_file(url), display, config)

    def prepare_writer(
        self, writer: Any, display: str, *, first: bool, ours: set[int],
        shared_lease: float | None,
    ) -> None:  # fmt: skip
        """Nothing: the lock file is held already, and no server process to name."""

    def unlock_writer(self, writer: Any, cursor: Any) -> None:
        """Nothing: the lock file is let go when the store closes."""

    def checkpointer(
        self, url: URL, display: str, config: GatewayConfig, *, read_only: bool
    ) -> Checkpointer | None:
        """A store opened for writing checkpoints on a thread of its own (see
        ``sqlite_checkpoint``)."""
        if read_only:
            return None
        storage = config.storage
        return Checkpointer(
            database_file(url), storage.sqlite_synchronous.upper(),
            storage.sqlite_busy_timeout_secs, display,
        )  # fmt: skip

    def secure_files(self, url: URL) -> None:
        """Mode 0600 on the ``-wal``/``-shm``/``-journal`` files, by path, after the first
        connection made them."""
        for suffix in _SIDECARS:
            sidecar = Path(f"{database_file(url)}{suffix}")
            try:
                info = os.lstat(sidecar)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
                os.chmod(sidecar, 0o600)

    def check_capacity(
        self, conn: Connection, display: str, writers: int, config: GatewayConfig
    ) -> None:
        """Nothing: no server to run out of connections."""

    def compiler(self, engine: Engine) -> Compiler:
        """Named parameters: rows go to the driver as they are, no tuples."""
        return sqlite.dialect(paramstyle="named")

    def insert(self, table: Table) -> OnConflictInsert:
        return sqlite.insert(table)

    def position(self, haystack: Any, needle: Any) -> ColumnElement[Any]:
        return func.instr(haystack, needle)

    def begin_ddl(self, cursor: Any) -> None:
        """DDL does not open pysqlite's implicit transaction."""
        cursor.execute("BEGIN IMMEDIATE")

    def put_meta(self, cursor: Any, sql: Statements, name: str, value: str) -> None:
        """The old row deleted, the new inserted (one writer: nobody races it)."""
        sql.delete_meta.run(cursor, {"key": name})
        sql.insert_meta.run(cursor, {"key": name, "value": value})

    def integrity_problems(self, store: SqlConnection) -> list[str]:
        """``integrity_check`` and ``foreign_key_check`` findings."""
        with store.read("checking the database's integrity") as conn:
            found = [str(row[0]) for row in conn.exec_driver_sql("PRAGMA integrity_check")]
            keys = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
        problems = [line for line in found if line != "ok"]
        problems += [f"{row[0]} row {row[1]} points at a missing {row[2]} row" for row in keys]
        return problems

    def begin_migration(self, conn: Connection, *, shared: bool) -> None:
        """``BEGIN IMMEDIATE``: the schema is read and changed under the write lock."""
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def create_search_index(self, conn: Connection) -> None:
        """FTS5 (skipped where this SQLite lacks it)."""
        if sqlite_fts.has_fts5(conn):
            sqlite_fts.create(conn)

    def index_behind_a_watermark(self, conn: Connection) -> None:
        sqlite_fts.index_behind_a_watermark(conn)

    def search_index(self, store: SqlConnection, conn: Connection) -> Fts5Index:
        return Fts5Index.opened(store, conn)
