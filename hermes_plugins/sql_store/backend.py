"""The SQL backend: SQLAlchemy Core over SQLite (default) or PostgreSQL.

:class:`SqlBackend` is what the store plugin's ``open`` returns: it implements the backend
protocols of ``hermes_core.store.backend`` (and the operator interface of
``hermes_core.store.operator``) by handing each method to the part that owns it. The parts
share one :class:`SqlConnection` (engine, dialect, writer connections, statements) and own
their own state: the routing index and a turn's start (``routes``), session rows
(``session_rows``), messages (``transcripts``), the full-text index (``search``, of the
dialect's kind), the ledger, the queue, restart counts, turn leases and lane wake-ups, and what
re-keying and the operator commands need. Each method is documented by its protocol. The
facade stays in one class on purpose, past 400 lines: a line or two per protocol method, so one
file shows every method the backend implements and the part that does it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import SessionEntry
from hermes_core.store.backend import (
    CounterDelta,
    DeadLetter,
    EntryDict,
    KeyMoves,
    LeaseTaken,
    Locked,
    Message,
    Obligation,
    SearchHit,
    SessionRow,
    StoredKeys,
)
from hermes_core.store.bulk import ImportCounts, ImportedLane
from hermes_core.store.operator import (
    Held,
    LaneFilter,
    LaneRow,
    RecordKinds,
    RouteChecks,
    TableDigest,
)
from hermes_plugins.sql_store.bulk import BulkRows
from hermes_plugins.sql_store.checks import CheckRows
from hermes_plugins.sql_store.connection import SqlConnection
from hermes_plugins.sql_store.counts import CountRows
from hermes_plugins.sql_store.lanes import lane_rows
from hermes_plugins.sql_store.leases import LeaseRows
from hermes_plugins.sql_store.ledger import SqlLedgerRows
from hermes_plugins.sql_store.operator import OperatorRows
from hermes_plugins.sql_store.queue import QueueRows
from hermes_plugins.sql_store.rekey import RekeyRows
from hermes_plugins.sql_store.routes import RoutingRows
from hermes_plugins.sql_store.session_rows import SessionRows
from hermes_plugins.sql_store.transcripts import TranscriptRows
from hermes_plugins.sql_store.wakeups import WakeupRows

if TYPE_CHECKING:
    from hermes_core.store.backend import (
        DurableQueue,
        LaneWakeups,
        LedgerRows,
        Maintenance,
        ParallelWriters,
        Pruning,
        RestartCountRows,
        SearchCapable,
        StoreBackend,
        TranscriptEditing,
        TurnLeases,
    )
    from hermes_core.store.operator import OperatorBackend


class SqlBackend:
    """The canonical store over SQLite or PostgreSQL: the required contract and every
    capability (which ones a dialect offers is declared by its ``StoreSpec``)."""

    def __init__(self, url: str, config: GatewayConfig, *, read_only: bool = False) -> None:
        conn = self._conn = SqlConnection(url, config, read_only=read_only)
        self.name = conn.dialect.name
        self.reads_ahead = conn.dialect.server_reads
        self._index = conn.index
        self._transcripts = TranscriptRows(conn)
        self._queue = QueueRows(conn)
        self._routes = RoutingRows(conn, self._queue, self._transcripts)
        self._sessions = SessionRows(conn, self._routes)
        self._ledger = SqlLedgerRows(conn, self._transcripts)
        self._counts = CountRows(conn)
        self._leases = LeaseRows(conn)
        self._wakeups = WakeupRows(conn)
        self._rekey = RekeyRows(conn)
        self._operator = OperatorRows(conn)
        self._checks = CheckRows(conn)
        self._bulk = BulkRows(conn)

    # -- StoreBackend -----------------------------------------------------------------------------

    def close(self) -> None:
        self._conn.close()

    def stats(self) -> dict[str, int]:
        return self._conn.stats()

    def transaction(self) -> AbstractContextManager[object]:
        return self._conn.transaction()

    def health(self) -> dict[str, Any]:
        return self._conn.health()

    def get_route(self, session_key: str) -> EntryDict | None:
        return self._routes.get_route(session_key)

    def get_routes(self, session_keys: Collection[str]) -> dict[str, EntryDict]:
        return self._routes.get_routes(session_keys)

    def get_route_by_session_id(self, session_id: str) -> EntryDict | None:
        return self._routes.get_route_by_session_id(session_id)

    def iter_routes(self) -> Iterator[EntryDict]:
        return self._routes.iter_routes()

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        self._routes.put_route(entry, touch=touch)

    def clear_turn_marker(self, entry: SessionEntry, token: str, *, rewrite: bool = False) -> bool:
        return self._routes.clear_turn_marker(entry, token, rewrite=rewrite)

    def begin_turn(
        self,
        entry: SessionEntry,
        consumed_event_id: int | None,
        user_message: tuple[str, Message] | None,
        seen: str | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> bool:
        return self._routes.begin_turn(
            entry, consumed_event_id, user_message, seen, lease, rewrite=rewrite
        )

    def routes_with_markers(self) -> list[EntryDict]:
        return self._routes.routes_with_markers()

    def routes_to_resume(self) -> list[EntryDict]:
        return self._routes.routes_to_resume()

    def put_routes(self, entries: Sequence[EntryDict]) -> None:
        self._routes.put_routes(entries)

    def get_session(self, session_id: str) -> SessionRow | None:
        return self._sessions.get_session(session_id)

    def newest_session(self, session_key: str) -> SessionRow | None:
        return self._sessions.newest_session(session_key)

    def count_sessions(self) -> int:
        return self._sessions.count_sessions()

    def create_session(
        self, row: SessionRow, entry: EntryDict, end_previous: tuple[str, str] | None
    ) -> None:
        self._sessions.create_session(row, entry, end_previous)

    def reopen_session(self, session_id: str, entry: EntryDict) -> None:
        self._sessions.reopen_session(session_id, entry)

    def update_counters(self, entry: EntryDict, session_id: str, delta: CounterDelta) -> None:
        self._sessions.update_counters(entry, session_id, delta)

    def append_message(self, session_id: str, message: Message) -> int:
        return self._transcripts.append_message(session_id, message)

    def load_messages(self, session_id: str) -> list[dict[str, Any]]:
        return self._transcripts.load_messages(session_id)

    # -- SearchCapable, TranscriptEditing, Pruning ------------------------------------------------

    def search(
        self, query: str, *, session_id: str | None, session_key: str | None, limit: int
    ) -> list[SearchHit]:
        return self._index.search(query, session_id=session_id, session_key=session_key,
                                  limit=limit)  # fmt: skip

    def rebuild_fts(self) -> bool:
        return self._index.rebuild_fts()

    def reindex_fts(self) -> None:
        self._index.reindex_fts()

    def start_fts_rebuild(self) -> bool:
        return self._index.start_fts_rebuild()

    def index_backlog(self) -> bool:
        return self._index.index_backlog()

    def rewrite_messages(self, session_id: str, messages: Sequence[Message]) -> int:
        return self._transcripts.rewrite_messages(session_id, messages)

    def soft_delete_messages(self, session_id: str, message_ids: Sequence[int]) -> int:
        return self._transcripts.soft_delete_messages(session_id, message_ids)

    def prune_candidates(
        self, cutoff: float, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        return self._routes.prune_candidates(cutoff, after, limit)

    def delete_idle_routes(self, session_keys: Sequence[str], cutoff: float) -> list[str]:
        return self._routes.delete_idle_routes(session_keys, cutoff)

    # -- LedgerRows -------------------------------------------------------------------------------

    def add_obligation(
        self,
        obligation: Obligation,
        marker: tuple[SessionEntry, str] | None,
        reply: tuple[str, Message] | None = None,
        lease: str | None = None,
        *,
        rewrite: bool = False,
    ) -> tuple[bool, bool]:
        return self._ledger.add_obligation(obligation, marker, reply, lease, rewrite=rewrite)

    def obligations(
        self, states: Sequence[str], platforms: Sequence[str] | None = None
    ) -> list[Obligation]:
        return self._ledger.obligations(states, platforms)

    def obligation_since(self, session_key: str, since: float) -> bool:
        return self._ledger.obligation_since(session_key, since)

    def update_obligation(self, obligation_id: str, changes: Mapping[str, Any]) -> None:
        self._ledger.update_obligation(obligation_id, changes)

    def delete_obligation(self, obligation_id: str) -> None:
        self._ledger.delete_obligation(obligation_id)

    def obligations_to_prune(self, terminal_before: float, max_rows: int) -> list[str]:
        return self._ledger.obligations_to_prune(terminal_before, max_rows)

    def delete_terminal_obligations(self, obligation_ids: Sequence[str]) -> int:
        return self._ledger.delete_terminal_obligations(obligation_ids)

    # -- DurableQueue, RestartCountRows -----------------------------------------------------------

    def add_queued(
        self, session_key: str, internal: bool, bound: str | None, event: str,
        seen: str | None = None,
    ) -> int | None:  # fmt: skip
        return self._queue.add_queued(session_key, internal, bound, event, seen)

    def fail_queued(self, event_id: int, error: str, max_attempts: int) -> bool:
        return self._queue.fail_queued(event_id, error, max_attempts)

    def dead_letters(self) -> list[DeadLetter]:
        return self._queue.dead_letters()

    def prune_seen(self, before: float, limit: int) -> int:
        return self._queue.prune_seen(before, limit)

    def remove_queued(self, event_ids: Sequence[int]) -> int:
        return self._queue.remove_queued(event_ids)

    def queued(self, session_key: str | None = None) -> list[tuple[int, str, str]]:
        return self._queue.queued(session_key)

    def restart_counts(self, owner: str) -> dict[str, int]:
        return self._counts.restart_counts(owner)

    def save_restart_counts(self, owner: str, counts: Mapping[str, int]) -> None:
        self._counts.save_restart_counts(owner, counts)

    def remove_restart_count(self, session_key: str) -> None:
        self._counts.remove_restart_count(session_key)

    # -- ParallelWriters, TurnLeases, LaneWakeups -------------------------------------------------

    def writer_connections(self) -> int:
        return self._conn.writer_connections()

    def bind_writer(self, index: int) -> None:
        self._conn.bind_writer(index)

    def take_lease(
        self, session_key: str, owner: str, boot: str, token: str, ttl: float,
        cached: int | None = None, *, reclaim: bool = False,
    ) -> LeaseTaken | Locked | None:  # fmt: skip
        return self._leases.take_lease(
            session_key, owner, boot, token, ttl, cached, reclaim=reclaim
        )

    def check_lease(self, session_key: str, token: str) -> bool:
        return self._leases.check_lease(session_key, token)

    def renew_leases(self, tokens: Sequence[str], ttl: float) -> set[str]:
        return self._leases.renew_leases(tokens, ttl)

    def release_lease(
        self, session_key: str, token: str, delivered: str | None = None
    ) -> list[tuple[int, str, str]] | Locked | None:
        return self._leases.release_lease(session_key, token, delivered)

    def give_up_leases(self, tokens: Sequence[str]) -> list[str]:
        return self._leases.give_up_leases(tokens)

    def read_route(self, session_key: str) -> tuple[EntryDict, int] | None:
        return self._routes.read_route(session_key)

    def checked_routes(
        self, expected: Mapping[str, int | None]
    ) -> AbstractContextManager[dict[str, int]]:
        return self._routes.checked_routes(expected)

    def orphaned_lanes(
        self, owner: str, boot: str, expired: bool, ttl: float
    ) -> list[tuple[str, int | None]]:
        return self._leases.orphaned_lanes(owner, boot, expired, ttl)

    def wake_lane(self, session_key: str) -> None:
        self._wakeups.wake_lane(session_key)

    def listen_lanes(self, woken: Callable[[str], None]) -> Callable[[], None]:
        return self._wakeups.listen_lanes(woken)

    # -- BacklogTarget, Maintenance ---------------------------------------------------------------

    def get_meta(self, name: str) -> str | None:
        return self._conn.get_meta(name)

    def import_backlog(
        self,
        session_id: str,
        new_messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        self._transcripts.import_backlog(session_id, new_messages, offset, create_row)

    def set_meta(self, name: str, value: str) -> None:
        self._rekey.set_meta(name, value)

    def stored_keys(self) -> StoredKeys:
        return self._rekey.stored_keys()

    def move_keys(self, moves: KeyMoves) -> None:
        self._rekey.move_keys(moves)

    def has_routes(self) -> bool:
        return self._routes.has_routes()

    def route_page(self, after: str | None, limit: int) -> list[EntryDict]:
        return self._routes.route_page(after, limit)

    def count_routes(self) -> int:
        return self._routes.count_routes()

    def import_routes(
        self, entries: Sequence[tuple[EntryDict, SessionRow]], marker: tuple[str, str]
    ) -> int:
        return self._routes.import_routes(entries, marker)

    # -- OperatorBackend --------------------------------------------------------------------------

    def record_kinds(self) -> RecordKinds:
        return self._operator.record_kinds()

    def integrity_problems(self) -> list[str]:
        return self._operator.integrity_problems()

    def fts_problems(self) -> list[str]:
        return self._index.fts_problems()

    def check_routes(self, after: str | None, limit: int) -> RouteChecks:
        return self._checks.check_routes(after, limit)

    def unreadable_events(self) -> list[str]:
        return self._checks.unreadable_events()

    def obligation_counts(self) -> dict[str, int]:
        return self._operator.obligation_counts()

    def lease_rows(self, session_key: str | None = None) -> list[tuple[str, str, float]]:
        return self._operator.lease_rows(session_key)

    def revive_queued(self, event_ids: Sequence[int]) -> int:
        return self._operator.revive_queued(event_ids)

    def lane_rows(
        self, lanes: LaneFilter, after: tuple[Any, ...] | None, limit: int
    ) -> list[LaneRow]:
        return lane_rows(self._conn, lanes, after, limit)

    def table_rows(
        self,
        name: str,
        after: Sequence[Any] | None,
        limit: int,
        upto: Sequence[Any] | None = None,
    ) -> list[dict[str, Any]]:
        return self._operator.table_rows(name, after, limit, upto)

    def span_end(self, name: str, after: Sequence[Any] | None, size: int) -> tuple[Any, ...] | None:
        return self._operator.span_end(name, after, size)

    def count_records(self, name: str) -> int:
        return self._operator.count_records(name)

    def primary_key(self, name: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
        return self._operator.primary_key(name, row)

    def insert_missing(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        return self._operator.insert_missing(name, rows)

    def held_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Held:
        return self._operator.held_rows(name, rows)

    def set_session_counts(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._operator.set_session_counts(rows)

    def finish_transfer(self) -> None:
        self._operator.finish_transfer()

    def table_digest(self, name: str) -> TableDigest:
        return self._operator.table_digest(name)

    def import_lanes(self, lanes: Sequence[ImportedLane]) -> ImportCounts:
        return self._bulk.import_lanes(lanes)


if TYPE_CHECKING:

    def _conforms(backend: SqlBackend) -> None:
        """The facade implements every protocol the core calls it by (checked by mypy)."""
        _required: StoreBackend = backend
        _search: SearchCapable = backend
        _edits: TranscriptEditing = backend
        _pruning: Pruning = backend
        _ledger: LedgerRows = backend
        _queue: DurableQueue = backend
        _counts: RestartCountRows = backend
        _writers: ParallelWriters = backend
        _leases: TurnLeases = backend
        _wakeups: LaneWakeups = backend
        _maintenance: Maintenance = backend
        _operator: OperatorBackend = backend
