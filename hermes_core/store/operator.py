"""The operator interface (capability ``operator``): what ``doctor``, ``migrate``, ``export``
and the dead-letter commands need beyond the gateway's operations (the built-in SQL backend
provides it). The commands know no table: the backend names its kinds of record
(:class:`RecordKinds`), and each method taking a ``name`` takes one of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hermes_core.store.backend import DeadLetter, Obligation

if TYPE_CHECKING:
    from hermes_core.store.bulk import ImportCounts, ImportedLane


@dataclass(frozen=True, slots=True)
class RecordKinds:
    """The kinds of record a backend keeps (its tables, for a SQL store), by what the operator
    commands do with them."""

    transfer: tuple[str, ...]
    """Every kind of stored state, in an order that inserts a record after the records it points
    at: what ``migrate`` copies and verifies."""
    export: tuple[str, ...]
    """What ``export --format jsonl`` writes, in this order."""
    sessions: str
    """The kind whose records are session rows, with the fields of
    :class:`~hermes_core.store.backend.SessionRow`: ``migrate`` restores their counts after a
    copy, ``export --format markdown`` writes a section for each."""
    routes: str
    """The kind whose records are routing entries, with ``session_key`` and ``session_id``:
    ``doctor`` compares them with ``sessions.json``."""


@dataclass(frozen=True, slots=True)
class LaneFilter:
    """Which lanes ``ls`` lists, and in which order."""

    sort: str = "updated"
    """``updated`` or ``created`` (newest first), ``key``, ``messages`` (most first); ties
    fall to the newest activity, then to the session key."""
    platform: str | None = None
    active_since: float | None = None
    """Only lanes active at or after this epoch time."""
    suspended: bool = False
    resume_pending: bool = False
    dead_lettered: bool = False


@dataclass(frozen=True, slots=True)
class LaneRow:
    """A lane as ``ls`` reads it: its stored entry (as the store's ``get_route`` gives it),
    its session's message count (0 without a session row) and where it stands in the order
    (what :meth:`OperatorBackend.lane_rows` takes as ``after``)."""

    entry: dict[str, Any]
    message_count: int
    position: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class TableDigest:
    """A kind's record count and the SHA-256 of its records in primary-key order."""

    rows: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Held:
    """How a kind holds some records of another store: ``same``, identically (key and values);
    ``other``, under their key with other values; the rest it lacks."""

    same: int
    other: int


@dataclass(frozen=True, slots=True)
class RouteChecks:
    """A page of routing records as ``doctor`` checks them."""

    sessions: list[tuple[str, str]]
    """Each record's session key and session id, in key order."""
    unreadable: list[str]
    """Records the store passes over (an entry that is not a JSON object, a time that is not
    one: ``ls``, ``show``, ``rekey`` and the gateway skip the lane), one line each."""
    dangling: list[str]
    """Records whose session is missing or ended, one line each."""


class OperatorBackend(Protocol):
    """Checks, record transfer and dead-letter revival."""

    name: str
    reads_ahead: bool
    """Whether a walk of many records is faster with its next read on a thread of its own,
    done while the caller works on the records read (a database server's reads, not an
    in-process database's)."""

    def record_kinds(self) -> RecordKinds:
        """The kinds of record this backend keeps, by what the commands do with them."""

    def close(self) -> None:
        """Close connections and release the writer lock."""

    def health(self) -> dict[str, Any]:
        """``backend``, ``fts`` (``ok``, ``stale``, ``unavailable``), ``available``."""

    def get_meta(self, name: str) -> str | None:
        """A ``state_meta`` value, or None."""

    def set_meta(self, name: str, value: str) -> None:
        """Set one ``state_meta`` value (one transaction): an import records the key schema
        of the lanes it wrote."""

    def integrity_problems(self) -> list[str]:
        """Database integrity and foreign-key findings (``[]`` when sound)."""

    def fts_problems(self) -> list[str]:
        """Full-text index integrity and probe findings (``[]`` when sound or unavailable)."""

    def check_routes(self, after: str | None, limit: int) -> RouteChecks:
        """Up to ``limit`` routing records in key order after the key ``after`` (None: from the
        first), checked: ``doctor`` walks the routing table a page at a time."""

    def unreadable_events(self) -> list[str]:
        """Queued events the store cannot read, one line each (read in bounded memory)."""

    def obligation_counts(self) -> dict[str, int]:
        """Ledger rows per state."""

    def obligations(
        self, states: Sequence[str], platforms: Sequence[str] | None = None
    ) -> list[Obligation]:
        """Ledger rows in the given states, oldest first."""

    def dead_letters(self) -> list[DeadLetter]:
        """Dead-lettered events, oldest first."""

    def queued(self) -> list[tuple[int, str, str]]:
        """Queued events (id, session key, event JSON), in queue order."""

    def lease_rows(self, session_key: str | None = None) -> list[tuple[str, str, float]]:
        """Turn leases of a shared store (session key, owner instance, expiry on the database
        server's clock), of every lane or of ``session_key``."""

    def remove_queued(self, event_ids: Sequence[int]) -> int:
        """Delete queued events (dead letters included); how many."""

    def prune_candidates(
        self, cutoff: float, after: str | None = None, limit: int | None = None
    ) -> list[str]:
        """Keys idle since before ``cutoff`` that are not suspended and have no marker.
        In key order; a page of a walk: only keys after ``after``, at most ``limit``."""

    def revive_queued(self, event_ids: Sequence[int]) -> int:
        """Put dead-lettered events back in their queues; how many."""

    def lane_rows(
        self, lanes: LaneFilter, after: tuple[Any, ...] | None, limit: int
    ) -> list[LaneRow]:
        """Up to ``limit`` lanes of ``lanes`` in its order, after the one at ``after`` (a
        :attr:`LaneRow.position`): a page costs the same however many lanes are stored."""

    def table_rows(
        self,
        name: str,
        after: Sequence[Any] | None,
        limit: int,
        upto: Sequence[Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` records of a kind in primary-key order after the key ``after`` and,
        when ``upto`` is given, at most that key."""

    def span_end(self, name: str, after: Sequence[Any] | None, size: int) -> tuple[Any, ...] | None:
        """The key of the ``size``-th record of a kind after the key ``after`` (from the first
        when None), found without reading the records themselves; None when fewer follow. The
        spans between such keys split a walk of :meth:`table_rows` into parts read apart."""

    def count_records(self, name: str) -> int:
        """How many records of a kind :meth:`table_rows` yields in all."""

    def primary_key(self, name: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The primary key of a record of the kind."""

    def insert_missing(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the records the kind lacks (by primary key), in one transaction that
        changes no other record (the copied sessions keep the message counts they came
        with)."""

    def held_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> Held:
        """How the kind holds ``rows`` (another store's records of it)."""

    def set_session_counts(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Set sessions' message counts and last activity to those of ``rows`` where they
        differ."""

    def finish_transfer(self) -> None:
        """Make a store filled in bulk ready for use (id sequences, the planner's statistics,
        stale-index record)."""

    def rebuild_fts(self) -> bool:
        """Rebuild the full-text index; False when it is unavailable."""

    def table_digest(self, name: str) -> TableDigest:
        """Record count and checksum of a kind."""

    def import_lanes(self, lanes: Sequence[ImportedLane]) -> ImportCounts:
        """Write each lane whose key is not routed and whose session does not exist (entry,
        session row, messages in order), in one transaction; a session's parent is kept only
        when it is an existing session of the same lane."""
