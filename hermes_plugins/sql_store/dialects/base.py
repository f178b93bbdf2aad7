"""The contract of a dialect: what one kind of database declares and does its own way.

A dialect object is chosen once, when a store opens, and asked wherever SQLite and PostgreSQL
differ: flags declare what the database allows, a few methods hold the statements and steps
that differ (the engine, the writer lock, an upsert, the full-text index, schema steps). Every
other statement is one definition for both, in SQLAlchemy Core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import ColumnElement, Connection, Engine, Table
from sqlalchemy import Dialect as Compiler
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL

OnConflictInsert = sqlite.Insert | postgresql.Insert
"""An insert that takes ``ON CONFLICT`` clauses (each dialect has its own class)."""

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_core.state.instance import LockFile
    from hermes_plugins.sql_store.connection import SqlConnection
    from hermes_plugins.sql_store.dialects.sqlite_checkpoint import Checkpointer
    from hermes_plugins.sql_store.search import SearchIndex
    from hermes_plugins.sql_store.statements import Statements


class Dialect(ABC):
    """One kind of database as the SQL store uses it (stateless: one object serves every
    store of that kind). Every member is abstract: a dialect declares each, if only to say
    that it needs nothing there."""

    name: ClassVar[str]
    """What ``health()`` and the operator commands call the backend."""
    parallel_writers: ClassVar[bool]
    """Several writer connections may commit at once (``storage.writer_connections``, one
    writer thread each); otherwise the store has one."""
    shared_instances: ClassVar[bool]
    """Several gateways may write the database at once (``storage.instances: shared``)."""
    one_round_trip: ClassVar[bool]
    """A turn's start and finish, a new session and a queued event each go as one statement
    (``postgresql_turns``): every statement is a round trip to a server."""
    server_reads: ClassVar[bool]
    """A read waits on a server process, the driver letting other threads run meanwhile, so a
    thread reading the next page overlaps a caller's work on this one (``export``). An
    in-process database reads on the caller's CPU instead, giving up and taking back the
    interpreter at every row: a reading thread beside a busy one slows both."""
    returning_ids: ClassVar[bool]
    """An insert reports its row's id with ``RETURNING``; otherwise the cursor's
    ``lastrowid`` does."""
    without_rowid: ClassVar[bool]
    """Tables keyed by text can drop the row id (schema version 6 rebuilds them so)."""
    count_trigger: ClassVar[tuple[str, ...]]
    """The DDL of the trigger that counts a session's messages (schema version 3; since
    version 11 it leaves them alone inside a copy's transaction, see :attr:`copy_begin`)."""
    copy_begin: ClassVar[tuple[str, ...]]
    """Statements that open a transaction of ``migrate``'s copy: until it ends, the message
    count trigger leaves the sessions as copied (their counts come with them)."""
    copy_end: ClassVar[tuple[str, ...]]
    """Statements that close such a transaction, before its commit."""
    after_copy: ClassVar[tuple[str, ...]]
    """Statements that make a database filled in bulk (``migrate``, the bulk import) ready for
    use."""

    # -- opening ------------------------------------------------------------------------------

    @abstractmethod
    def create_engine(
        self, url: URL, display: str, config: GatewayConfig, *, read_only: bool, pooled: int
    ) -> Engine:
        """The engine of a store at ``url`` (``display``: the URL for messages); ``pooled``:
        the connections it may hold at once, where it pools them."""

    @abstractmethod
    def lock_database(self, url: URL, display: str, config: GatewayConfig) -> LockFile | None:
        """Take the one-writer lock where the writer connections do not hold it themselves
        (see :meth:`prepare_writer`); None where they do."""

    @abstractmethod
    def prepare_writer(
        self, writer: Any, display: str, *, first: bool, ours: set[int],
        shared_lease: float | None,
    ) -> int | None:  # fmt: skip
        """Make a new writer connection (a DBAPI connection) ready to write, or raise
        ``GatewayLockedError``; the server process it talks to, where there is one.
        ``first``: the store's first; ``ours``: the server processes of the store's other
        writer connections; ``shared_lease``: a shared store's turn lease in seconds (its
        writers hold no writer lock), None when not shared."""

    @abstractmethod
    def unlock_writer(self, writer: Any, cursor: Any) -> None:
        """Give up a writer connection's hold of the writer lock before it closes."""

    def checkpointer(
        self, url: URL, display: str, config: GatewayConfig, *, read_only: bool
    ) -> Checkpointer | None:
        """The thread that checkpoints the store's log off the writer's path, where the
        database leaves that to its clients (SQLite); None where the server does it."""
        return None

    @abstractmethod
    def secure_files(self, url: URL) -> None:
        """Tighten the modes of the files the database made beside its own."""

    @abstractmethod
    def check_capacity(
        self, conn: Connection, display: str, writers: int, config: GatewayConfig
    ) -> None:
        """Refuse (or warn about) a store whose connections cannot fit on the server."""

    @abstractmethod
    def compiler(self, engine: Engine) -> Compiler:
        """The SQLAlchemy dialect the store's statements are compiled for once."""

    # -- statements ---------------------------------------------------------------------------

    @abstractmethod
    def insert(self, table: Table) -> OnConflictInsert:
        """An insert that takes ``ON CONFLICT`` clauses."""

    @abstractmethod
    def position(self, haystack: Any, needle: Any) -> ColumnElement[Any]:
        """Where ``needle`` starts in ``haystack`` (1-based; 0: absent)."""

    def code_point_order(self, column: Any) -> ColumnElement[Any]:
        """``column`` to sort by in Python's string order (code points), whatever the
        database's collation; SQLite's default (``BINARY`` over UTF-8) already is."""
        return column  # type: ignore[no-any-return]

    @abstractmethod
    def begin_ddl(self, cursor: Any) -> None:
        """Open the transaction of a write that runs DDL (where DDL does not open one)."""

    @abstractmethod
    def put_meta(self, cursor: Any, sql: Statements, name: str, value: str) -> None:
        """Set one ``state_meta`` value on the writer's cursor."""

    @abstractmethod
    def integrity_problems(self, store: SqlConnection) -> list[str]:
        """The database's integrity findings, where the store checks its pages."""

    # -- schema and the full-text index -------------------------------------------------------

    @abstractmethod
    def begin_migration(self, conn: Connection, *, shared: bool) -> None:
        """Start the transaction that creates or upgrades the schema, so that processes starting
        together never do it twice."""

    @abstractmethod
    def create_search_index(self, conn: Connection) -> None:
        """Schema version 2: the derived full-text index over the messages."""

    @abstractmethod
    def index_behind_a_watermark(self, conn: Connection) -> None:
        """Schema version 4: the full-text index trails the messages (see ``sqlite_fts``)."""

    @abstractmethod
    def search_index(self, store: SqlConnection, conn: Connection) -> SearchIndex:
        """The store's full-text index, its state read on ``conn`` while the store opens."""
