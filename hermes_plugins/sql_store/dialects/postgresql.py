"""PostgreSQL through psycopg 3: several writer connections, the writer lock on the server, a
``tsvector`` index, one round trip per commit of a turn (``postgresql_turns``).

Every connection carries timeouts (:data:`SESSION_TIMEOUTS`), so no statement, lock wait or
forgotten transaction holds a connection for ever. Each writer connection of a store holds the
session-level advisory writer lock (see ``exclusive``); on a shared store none does, and their
sessions get shorter lock and idle timeouts instead (:func:`shared_writer_timeouts`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Connection, Engine, Table, func
from sqlalchemy import Dialect as Compiler
from sqlalchemy import create_engine as sqlalchemy_engine
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL

from hermes_core.domain.errors import StoreUnavailableError
from hermes_plugins.sql_store import exclusive
from hermes_plugins.sql_store.dialects.base import Dialect, OnConflictInsert
from hermes_plugins.sql_store.dialects.postgresql_search import TsvectorIndex
from hermes_plugins.sql_store.schema import metadata
from hermes_plugins.sql_store.search import SearchIndex

if TYPE_CHECKING:
    from hermes_core.config.schema import GatewayConfig
    from hermes_plugins.sql_store.connection import SqlConnection
    from hermes_plugins.sql_store.statements import Statements

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECS = 10
"""How long opening a connection may take (a reconnect never hangs longer)."""

SESSION_TIMEOUTS = {
    "statement_timeout": "300s", "lock_timeout": "30s",
    "idle_in_transaction_session_timeout": "120s",
}  # fmt: skip
"""Set on every connection: no statement, lock wait or forgotten transaction holds a connection
(and the rows it locked) for ever."""

_SEARCH = (
    "ALTER TABLE messages ADD COLUMN IF NOT EXISTS search_tsv tsvector GENERATED ALWAYS AS "
    "(to_tsvector('simple'::regconfig, left(coalesce(CASE WHEN role = 'tool' THEN "
    "left(content, 8192) ELSE content END, '') || ' ' || coalesce(tool_name, '') || ' ' || "
    "coalesce(tool_calls, ''), 65536))) STORED",
    "CREATE INDEX IF NOT EXISTS ix_messages_search ON messages USING gin (search_tsv)",
)
_SEQUENCES = ("messages", "queued_events")
COPYING_SETTING = "hermes.copying"
"""A setting of the transaction (any role may set one of a dotted name) that the message-count
trigger's function reads: ``on`` inside a transaction of ``migrate``'s copy."""


def shared_writer_timeouts(turn_lease_secs: float) -> dict[str, str]:
    """A shared store's writer sessions (set when each connects): a lock wait, and a transaction
    left open by a process that froze, end after a quarter of a lease (at least a second), so
    a frozen process's locks are gone long before its leases expire and can be taken over."""
    bound = f"{max(1000, int(turn_lease_secs * 250))}ms"
    return {"lock_timeout": bound, "idle_in_transaction_session_timeout": bound}


class PostgresqlDialect(Dialect):
    """PostgreSQL through psycopg 3."""

    name = "postgresql"
    parallel_writers = True
    shared_instances = True
    one_round_trip = True
    server_reads = True
    returning_ids = True
    without_rowid = False
    count_trigger = (
        "CREATE OR REPLACE FUNCTION hermes_count_message() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN IF current_setting('{COPYING_SETTING}', true) = 'on' THEN RETURN NULL; END IF; "
        "UPDATE sessions SET message_count = message_count + 1, "
        "last_activity_at = NEW.timestamp WHERE id = NEW.session_id; RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS messages_count ON messages",
        "CREATE TRIGGER messages_count AFTER INSERT ON messages FOR EACH ROW "
        "EXECUTE FUNCTION hermes_count_message()",
    )
    copy_begin = (f"SET LOCAL {COPYING_SETTING} = 'on'",)
    copy_end = ()  # the setting ends with the transaction
    after_copy = (
        *(
            f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
            f"coalesce((SELECT max(id) FROM {name}), 0) + 1, false)"
            for name in _SEQUENCES
        ),
        "ANALYZE " + ", ".join(table.name for table in metadata.sorted_tables),
    )
    """The id sequences moved past the copied ids, and the planner's statistics of every
    table taken: until autovacuum gets to rows written in bulk, the planner knows nothing of
    them and misjudges what its queries read (a table of millions planned as empty)."""

    def create_engine(
        self, url: URL, display: str, config: GatewayConfig, *, read_only: bool, pooled: int
    ) -> Engine:
        """A pool of ``pooled`` connections, none beyond: the writers' connections (and a
        shared store's listener) come from it too and stay checked out, the readers get the
        rest. A read-only store's are refused writes by the server too."""
        settings: dict[str, Any] = {
            "application_name": exclusive.application_name(config),
            "connect_timeout": CONNECT_TIMEOUT_SECS,
        }
        options = [f"-c {name}={value}" for name, value in SESSION_TIMEOUTS.items()]
        if read_only:
            options.append("-c default_transaction_read_only=on")
        settings["options"] = " ".join(options)
        # A plain postgresql:// means psycopg 3 here (SQLAlchemy's default is psycopg2).
        url = url.set(drivername="postgresql+psycopg")
        try:
            return sqlalchemy_engine(
                url, pool_pre_ping=True, connect_args=settings, pool_size=pooled, max_overflow=0
            )
        except ImportError as exc:  # the driver is imported when the engine is created
            raise StoreUnavailableError(
                f"{display}: the PostgreSQL driver psycopg cannot be imported ({exc}); "
                "install hermes-sessions[postgres]: pip install 'hermes-sessions[postgres]'."
            ) from exc

    def lock_database(self, url: URL, display: str, config: GatewayConfig) -> None:
        """None: the writer connections hold the lock (:meth:`prepare_writer`)."""
        return

    def prepare_writer(
        self, writer: Any, display: str, *, first: bool, ours: set[int],
        shared_lease: float | None,
    ) -> int:  # fmt: skip
        """The connection holds the writer lock (see ``exclusive.lock_postgres``) or, on a
        shared store, gets :func:`shared_writer_timeouts`; committed before it is used."""
        cursor = writer.cursor()
        try:
            backend_pid = int(cursor.execute("SELECT pg_backend_pid()").fetchone()[0])
            if shared_lease is not None:
                for name, value in shared_writer_timeouts(shared_lease).items():
                    cursor.execute(f"SET {name} = '{value}'")
            else:
                exclusive.lock_postgres(cursor, display, first=first, ours=ours | {backend_pid})
        finally:
            cursor.close()
        writer.commit()
        return backend_pid

    def unlock_writer(self, writer: Any, cursor: Any) -> None:
        """Released at once: the server ends a closed session's locks only once its process
        notices, and the next writer may be starting already."""
        writer.rollback()
        cursor.execute(exclusive.UNLOCK_SHARED)
        writer.commit()

    def secure_files(self, url: URL) -> None:
        """Nothing: the server keeps its own files."""

    def check_capacity(
        self, conn: Connection, display: str, writers: int, config: GatewayConfig
    ) -> None:
        """The writers and readers must fit within the server's ``max_connections``: refused
        if they never can, a warning if not beside the connections open now."""
        row = conn.exec_driver_sql(exclusive.CONNECTION_LIMITS).one()
        conn.rollback()
        # Open already: the first writer connection and the one this check reads on.
        warning = exclusive.check_connections(
            display, writers, config.storage.read_connections, (row[0], row[1], row[2]),
            ours=2, listening=config.storage.instances == "shared",
        )  # fmt: skip
        if warning is not None:
            logger.warning("%s", warning)

    def compiler(self, engine: Engine) -> Compiler:
        """The engine's own (psycopg's named ``%(name)s`` parameters)."""
        return engine.dialect

    def insert(self, table: Table) -> OnConflictInsert:
        return postgresql.insert(table)

    def position(self, haystack: Any, needle: Any) -> ColumnElement[Any]:
        return func.strpos(haystack, needle)

    def code_point_order(self, column: Any) -> ColumnElement[Any]:
        """The ``C`` collation: byte order of UTF-8, which is code point order."""
        return column.collate("C")  # type: ignore[no-any-return]

    def begin_ddl(self, cursor: Any) -> None:
        """Nothing: DDL runs in the transaction the driver opened."""

    def put_meta(self, cursor: Any, sql: Statements, name: str, value: str) -> None:
        """An upsert: processes starting together may race here."""
        cursor.execute(
            "INSERT INTO state_meta (key, value) VALUES (%(key)s, %(value)s) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            {"key": name, "value": value},
        )

    def integrity_problems(self, store: SqlConnection) -> list[str]:
        """None: the server keeps its own pages consistent."""
        return []

    def begin_migration(self, conn: Connection, *, shared: bool) -> None:
        """A shared store has no writer lock: processes starting together queue up here (the
        lock ends with the transaction); otherwise the writer lock is held already."""
        if shared:
            conn.exec_driver_sql(exclusive.MIGRATION_LOCK)

    def create_search_index(self, conn: Connection) -> None:
        """A generated ``tsvector`` column and its GIN index."""
        for statement in _SEARCH:
            conn.exec_driver_sql(statement)

    def index_behind_a_watermark(self, conn: Connection) -> None:
        """Nothing: the generated column follows every insert."""

    def search_index(self, store: SqlConnection, conn: Connection) -> TsvectorIndex:
        return TsvectorIndex(store, SearchIndex.stored_state(conn))
