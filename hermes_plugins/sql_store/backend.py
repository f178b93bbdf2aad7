"""The SQL backend: SQLAlchemy Core over SQLite (default) or PostgreSQL (SPEC §3.5, §12).

One writer connection, guarded by a lock, carries every write (SQLite has one writer anyway; on
PostgreSQL it keeps commit order simple); reads use pooled connections so they never wait for it.
Each write method is one transaction committed before it returns.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

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
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from hermes_core.config import GatewayConfig
from hermes_core.errors import (
    CorruptDatabaseError,
    DuplicateSessionIdError,
    InvalidValueError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
)
from hermes_core.store.backend import (
    MESSAGE_COLUMNS,
    MESSAGE_ROLES,
    CounterDelta,
    EntryDict,
    Message,
    SearchHit,
    SessionRow,
)
from hermes_core.store.files import create_private_file, ensure_private_dir
from hermes_plugins.sql_store import search
from hermes_plugins.sql_store.schema import (
    FTS_TRIGGERS,
    MIGRATIONS,
    SCHEMA_VERSION,
    SQLITE_FTS_TRIGGERS,
    gateway_routing,
    messages,
    reset_sqlite_fts,
    schema_version,
    sessions,
    sqlite_has_fts5,
    state_meta,
)
from hermes_plugins.sql_store.statements import Statements

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_SESSION_COLUMNS = tuple(SessionRow.__dataclass_fields__)
_SIDECARS = ("-wal", "-shm", "-journal")


def display_url(url: URL) -> str:
    """The URL without credentials, for messages and logs."""
    return url.set(username=None, password=None).render_as_string(hide_password=True)


def _epoch(stamp: object) -> float | None:
    """Epoch seconds of an ISO entry time (None stays None)."""
    return datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None


def _message_row(session_id: str, message: Message) -> dict[str, Any]:
    """A transcript message as column values; unknown keys go to ``extra_json``."""
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        allowed = ", ".join(sorted(MESSAGE_ROLES))
        raise InvalidValueError("role", f"message role {role!r} is not one of: {allowed}.")
    stamp = message.get("timestamp")
    if stamp is None:
        stamp = time.time()
    elif isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise InvalidValueError("timestamp", "message timestamp must be epoch seconds (a number).")
    content = message.get("content")
    extras = {k: v for k, v in message.items() if k not in MESSAGE_COLUMNS and k != "id"}
    if content is not None and not isinstance(content, str):
        extras["content"] = content  # structured content round-trips through extra_json
        content = None
    tool_calls = message.get("tool_calls")
    row = {name: message.get(name) for name in MESSAGE_COLUMNS}
    row.update(
        session_id=session_id,
        content=content,
        timestamp=float(stamp),
        tool_calls=None if tool_calls is None else json.dumps(tool_calls, ensure_ascii=False),
        extra_json=json.dumps(extras, ensure_ascii=False) if extras else None,
    )
    return row


def _message_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stored message as the mapping ``load_transcript`` returns (with its ``id``)."""
    message: dict[str, Any] = {"id": row["id"]}
    for name in MESSAGE_COLUMNS:
        value = row[name]
        if value is not None:
            message[name] = json.loads(value) if name == "tool_calls" else value
    if row["extra_json"]:
        message.update(json.loads(row["extra_json"]))
    return message


def _session_values(row: SessionRow) -> dict[str, Any]:
    """Column values of a session row."""
    values = {name: getattr(row, name) for name in _SESSION_COLUMNS}
    values["expiry_finalized"] = int(row.expiry_finalized)
    return values


def _route_params(entry: EntryDict) -> dict[str, Any]:
    """Column copies of an entry beside its authoritative ``entry_json``."""
    return {
        "session_key": entry["session_key"],
        "session_id": entry["session_id"],
        "updated_at": _epoch(entry["updated_at"]),
        "suspended": int(bool(entry.get("suspended"))),
        "resume_pending": int(bool(entry.get("resume_pending"))),
        "active_turn_token": entry.get("active_turn_token"),
        "entry_json": json.dumps(entry, ensure_ascii=False, separators=(",", ":")),
    }


class SqlBackend:
    """The canonical store over SQLite or PostgreSQL."""

    durable_queue = True

    def __init__(self, url: str, config: GatewayConfig) -> None:
        self.url = make_url(url)
        self.display = display_url(self.url)
        self.name = "sqlite" if self.url.get_backend_name() == "sqlite" else "postgresql"
        self._lock = threading.Lock()
        self._warned_fts = False
        self._closed = False
        self._engine = self._create_engine(config)
        self._driver_error: type[Exception] = self._engine.dialect.loaded_dbapi.Error
        try:
            with self._engine.connect() as conn:
                if self.name == "sqlite":
                    self._tighten_sidecars()
                self._migrate(conn)
                self._fts = self._fts_state(conn)
            self._writer = self._engine.raw_connection()
        except SQLAlchemyError as exc:
            self._engine.dispose()
            raise self._translate(exc, "opening the store", unavailable=True) from exc
        except StoreError:
            self._engine.dispose()
            raise
        self._cursor = self._writer.cursor()
        self._sql = Statements(self._engine.dialect)

    # -- connections ------------------------------------------------------------------------------

    def _create_engine(self, config: GatewayConfig) -> Engine:
        if self.name != "sqlite":
            return create_engine(self.url, pool_pre_ping=True)
        database = self.url.database
        if not database or database == ":memory:":
            raise StoreUnavailableError(
                f"{self.display}: an in-memory SQLite database cannot be shared by the store's "
                "connections; use a file path such as sqlite:////path/to/state.db."
            )
        self.path = Path(database)
        try:
            ensure_private_dir(self.path.parent)
            create_private_file(self.path, b"")
            info = os.lstat(self.path)
        except OSError as exc:
            raise StoreUnavailableError(f"{self.display}: cannot create the file: {exc}") from exc
        if not stat.S_ISREG(info.st_mode):
            raise StoreUnavailableError(
                f"{self.display}: {self.path} is not a regular file (a symlink or device); move "
                "it aside or point storage.url at a regular file."
            )
        engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 5.0})
        synchronous = config.storage.sqlite_synchronous.upper()

        @event.listens_for(engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Implicit transactions start with BEGIN IMMEDIATE: a write never upgrades a read lock.
            dbapi_connection.isolation_level = "IMMEDIATE"
            dbapi_connection.execute("PRAGMA foreign_keys=ON")
            dbapi_connection.execute("PRAGMA busy_timeout=5000")
            mode = dbapi_connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                logger.warning(
                    "%s: WAL journal refused (mode %s); using it as is", self.display, mode
                )
            dbapi_connection.execute(f"PRAGMA synchronous={synchronous}")

        return engine

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

    @contextmanager
    def _write(self, what: str, *, ddl: bool = False) -> Iterator[Any]:
        """One write transaction on the writer's DBAPI cursor, committed on success.

        Statements are Core, compiled once (``Statements``); executing them on the driver
        directly keeps a one-row transaction close to the cost of raw SQL.
        """
        with self._lock:
            try:
                if (
                    ddl and self.name == "sqlite"
                ):  # DDL does not open pysqlite's implicit transaction
                    self._cursor.execute("BEGIN IMMEDIATE")
                yield self._cursor
                self._writer.commit()
            except BaseException as exc:
                try:
                    self._writer.rollback()
                except self._driver_error:
                    logger.debug("rollback after a failed write also failed", exc_info=True)
                if isinstance(exc, self._driver_error):
                    raise self._translate(exc, what) from exc
                raise

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        """A pooled read connection (never blocked by the writer)."""
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
        """Close the writer and every pooled connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._cursor.close()
                self._writer.close()
            finally:
                self._engine.dispose()

    # -- schema ---------------------------------------------------------------------------------

    def _migrate(self, conn: Connection) -> None:
        """Create or upgrade the schema in one transaction; refuse a newer schema."""
        if self.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            tables = set(self._engine.dialect.get_table_names(conn))
            current = 0
            if "schema_version" in tables:
                found = conn.execute(select(func.max(schema_version.c.version))).scalar()
                current = int(found or 0)
            if current > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"{self.display}: the database has schema version {current}, newer than "
                    f"version {SCHEMA_VERSION} supported by this hermes-sessions; upgrade "
                    "hermes-sessions (the database was left untouched)."
                )
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

    def _triggers_present(self) -> bool:
        return self.name == "sqlite" and self._fts == "ok"

    def _disable_fts(self, error: StoreError) -> None:
        """Fail open: drop the FTS triggers and mark the index stale (separate transaction)."""
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

    def _with_fts_fail_open(self, write: Callable[[], _T]) -> _T:
        """Run a write that inserts messages; an error raised by the FTS triggers (the write
        succeeds once they are dropped) leaves the index stale instead of losing the message."""
        try:
            return write()
        except StoreError as first:
            if not self._triggers_present() or isinstance(first, StoreUnavailableError):
                raise
            if "locked" in str(first).lower():
                return write()  # one retry on a busy database
            self._disable_fts(first)
            return write()

    def rebuild_fts(self) -> bool:
        """Rebuild the derived index and clear ``fts_stale``; False when FTS5 is unavailable."""
        if self._fts == "unavailable":
            return False
        with self._write("rebuilding the full-text index", ddl=True) as cursor:
            if self.name == "sqlite":
                for trigger in FTS_TRIGGERS:
                    cursor.execute(f"DROP TRIGGER IF EXISTS {trigger}")
                reset_sqlite_fts(cursor)
                cursor.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
                for statement in SQLITE_FTS_TRIGGERS:
                    cursor.execute(statement)
            else:
                cursor.execute("REINDEX INDEX ix_messages_search")
            self._sql.delete_meta.run(cursor, {"key": "fts_stale"})
        self._engine.dispose()  # pooled readers may still hold the broken index's connection
        self._fts = "ok"
        return True

    # -- meta, health -----------------------------------------------------------------------------

    def _set_meta(self, cursor: Any, name: str, value: str) -> None:
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
        """``backend`` and ``fts`` state."""
        return {"backend": self.name, "fts": self._fts}

    # -- routing index --------------------------------------------------------------------------

    def get_route(self, session_key: str) -> EntryDict | None:
        """The stored entry of a key, or None."""
        query = select(gateway_routing.c.entry_json).where(
            gateway_routing.c.session_key == session_key
        )
        with self._read("reading a routing entry") as conn:
            text = conn.execute(query).scalar()
        return None if text is None else dict(json.loads(text))

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        """The entry whose current session id is ``session_id``, or None."""
        query = select(gateway_routing.c.entry_json).where(
            gateway_routing.c.session_id == session_id
        )
        with self._read("reading a routing entry") as conn:
            text = conn.execute(query.limit(1)).scalar()
        return None if text is None else dict(json.loads(text))

    def iter_routes(self) -> Iterator[EntryDict]:
        """Every routing entry, from one consistent read."""
        query = select(gateway_routing.c.entry_json).order_by(gateway_routing.c.session_key)
        with self._read("reading the routing index") as conn:
            rows = conn.execute(query).scalars().all()
        return (dict(json.loads(text)) for text in rows)

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        """Upsert one routing row (revision + 1)."""
        params = _route_params(entry)
        with self._write("writing a routing entry") as cursor:
            self._sql.upsert_route.run(cursor, params)

    def clear_turn_marker(self, entry: EntryDict, token: str) -> bool:
        """Write ``entry`` iff the stored marker is still ``token`` (compare-and-swap)."""
        params = _route_params(entry) | {"token": token}
        with self._write("clearing a turn marker") as cursor:
            return bool(self._sql.clear_marker.run(cursor, params).rowcount == 1)

    def begin_turn(
        self,
        entry: EntryDict,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
    ) -> None:
        """Marker, queue dequeue and the user message in one transaction."""
        route = _route_params(entry)
        message = _message_row(*user_message) if user_message is not None else None

        def write() -> None:
            with self._write("starting a turn") as cursor:
                self._sql.upsert_route.run(cursor, route)
                if consumed_event_id is not None:
                    self._sql.delete_queued.run(cursor, {"event_id": consumed_event_id})
                if message is not None:
                    self._insert_message(cursor, message)

        self._with_fts_fail_open(write)

    def delete_routes(self, session_keys: Sequence[str]) -> int:
        """Remove routing rows in one transaction."""
        if not session_keys:
            return 0
        removed = 0
        with self._write("pruning routing entries") as cursor:
            for key in session_keys:
                removed += self._sql.delete_route.run(cursor, {"session_key": key}).rowcount
        return removed

    def has_routes(self) -> bool:
        """Whether any routing row exists."""
        with self._read("reading the routing index") as conn:
            return conn.execute(select(gateway_routing.c.session_key).limit(1)).first() is not None

    def import_routes(self, entries: Sequence[EntryDict], marker: tuple[str, str]) -> int:
        """Insert the entries whose key is missing and record ``marker``, in one transaction."""
        with self._read("reading the routing index") as conn:
            present = set(conn.execute(select(gateway_routing.c.session_key)).scalars())
        missing = [entry for entry in entries if entry["session_key"] not in present]
        with self._write("importing routing entries") as cursor:
            for entry in missing:
                self._sql.upsert_route.run(cursor, _route_params(entry))
            self._set_meta(cursor, *marker)
        return len(missing)

    def prune_candidates(self, cutoff: float) -> list[str]:
        """Keys idle since before ``cutoff`` that are not suspended and have no marker."""
        query = select(gateway_routing.c.session_key).where(
            gateway_routing.c.updated_at < cutoff,
            gateway_routing.c.suspended == 0,
            gateway_routing.c.active_turn_token.is_(None),
        )
        with self._read("finding stale routing entries") as conn:
            return list(conn.execute(query).scalars())

    # -- sessions -------------------------------------------------------------------------------

    def _session(self, query: Any, what: str) -> SessionRow | None:
        with self._read(what) as conn:
            row = conn.execute(query).mappings().first()
        if row is None:
            return None
        values = {name: row[name] for name in _SESSION_COLUMNS}
        values["expiry_finalized"] = bool(values["expiry_finalized"])
        return SessionRow(**values)

    def get_session(self, session_id: str) -> SessionRow | None:
        """One session row, or None."""
        return self._session(
            select(sessions).where(sessions.c.id == session_id), "reading a session"
        )

    def newest_session(self, session_key: str) -> SessionRow | None:
        """The most recently started session of a key."""
        query = (
            select(sessions)
            .where(sessions.c.session_key == session_key)
            .order_by(sessions.c.started_at.desc())
            .limit(1)
        )
        return self._session(query, "reading a session")

    def count_sessions(self) -> int:
        """Session rows, counted up to 2 (all ``has_any_sessions`` needs)."""
        query = select(func.count()).select_from(select(sessions.c.id).limit(2).subquery())
        with self._read("counting sessions") as conn:
            return int(conn.execute(query).scalar() or 0)

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        """End the predecessor, insert the row and write the routing entry, in one transaction."""
        route = _route_params(entry)
        try:
            with self._write("creating a session") as cursor:
                if end_previous is not None:
                    ending = {"session_id": end_previous[0], "end_reason": end_previous[1]}
                    self._sql.end_session.run(cursor, ending | {"ended_at": time.time()})
                self._sql.insert_session.run(cursor, _session_values(row))
                self._sql.upsert_route.run(cursor, route)
        except StoreError as exc:
            problem = str(exc.__cause__).lower()
            if "sessions" in problem and ("unique" in problem or "duplicate" in problem):
                raise DuplicateSessionIdError(f"session id {row.id} already exists") from exc
            raise

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        """Clear the row's end and write the routing entry, in one transaction."""
        route = _route_params(entry)
        with self._write("reopening a session") as cursor:
            self._sql.reopen_session.run(cursor, {"session_id": session_id})
            self._sql.upsert_route.run(cursor, route)

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        """Write the entry and add ``delta`` to the session row, in one transaction."""
        route = _route_params(entry)
        params = {name: getattr(delta, name) for name in CounterDelta.__dataclass_fields__}
        params["session_id"] = session_id
        with self._write("updating session counters") as cursor:
            self._sql.upsert_route.run(cursor, route)
            self._sql.add_counters.run(cursor, params)

    # -- transcripts ----------------------------------------------------------------------------

    def _insert_message(self, cursor: Any, row: Mapping[str, Any]) -> int:
        self._sql.insert_message.run(cursor, row)
        message_id = cursor.lastrowid if self.name == "sqlite" else cursor.fetchone()[0]
        self._sql.count_message.run(cursor, row)
        return int(message_id)

    def append_message(self, session_id: str, message: Message) -> int:
        """Insert one message (FTS fails open); returns its id."""
        row = _message_row(session_id, message)

        def write() -> int:
            with self._write("appending a message") as cursor:
                return self._insert_message(cursor, row)

        return self._with_fts_fail_open(write)

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        """Active messages of a session in insertion order."""
        query = (
            select(messages)
            .where(messages.c.session_id == session_id, messages.c.active == 1)
            .order_by(messages.c.id)
        )
        with self._read("loading a transcript") as conn:
            return [_message_dict(dict(row)) for row in conn.execute(query).mappings()]

    def rewrite_messages(self, session_id: str, new_messages: Sequence[Message]) -> int:
        """Deactivate the active messages and append ``new_messages``, in one transaction."""
        rows = [_message_row(session_id, message) for message in new_messages]

        def write() -> int:
            with self._write("rewriting a transcript") as cursor:
                self._sql.deactivate_messages.run(cursor, {"session_id": session_id})
                self._sql.set_message_count.run(
                    cursor, {"session_id": session_id, "message_count": 0}
                )
                for row in rows:
                    self._insert_message(cursor, row)
            return len(rows)

        return self._with_fts_fail_open(write)

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        """Deactivate messages of the session; never deletes rows."""
        if not message_ids:
            return 0
        count = 0
        with self._write("deleting messages") as cursor:
            for message_id in message_ids:
                params = {"session_id": session_id, "message_id": message_id}
                count += self._sql.deactivate_message.run(cursor, params).rowcount
            self._sql.uncount_messages.run(cursor, {"session_id": session_id, "removed": count})
        return count

    def search(
        self, query: str, *, session_id: str | None, session_key: str | None, limit: int
    ) -> list[SearchHit]:
        """Full-text search; a failing index (or a stale one) degrades to a scan."""
        with self._read("searching transcripts") as conn:
            if self._fts == "ok":
                try:
                    return search.indexed(conn, self.name, query, session_id, session_key, limit)
                except SQLAlchemyError as exc:
                    conn.rollback()
                    self._disable_fts(self._translate(exc, "searching"))
            if not self._warned_fts:
                self._warned_fts = True
                logger.warning("%s: full-text index %s; searching by scan", self.display, self._fts)
            return search.scan(conn, query, session_id, session_key, limit)

    # -- JSONL backlog replay -------------------------------------------------------------------

    def import_backlog(
        self,
        session_id: str,
        new_messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        """Create the session row if needed, append messages, store the offset: one transaction."""
        rows = [_message_row(session_id, message) for message in new_messages]

        def write() -> None:
            with self._write("replaying the JSONL backlog") as cursor:
                if create_row is not None:
                    self._sql.insert_session.run(cursor, _session_values(create_row))
                for row in rows:
                    self._insert_message(cursor, row)
                self._set_meta(cursor, *offset)

        self._with_fts_fail_open(write)
