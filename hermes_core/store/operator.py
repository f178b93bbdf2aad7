"""The SQL store's operator interface: what ``doctor``, ``migrate`` and the dead-letter
commands need beyond the gateway's operations (the built-in SQL backend provides it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hermes_core.store.backend import DeadLetter, Obligation

TRANSFER_TABLES = (
    "state_meta", "sessions", "messages", "gateway_routing", "delivery_obligations",
    "queued_events", "seen_messages", "session_turn_leases", "restart_failure_counts",
)  # fmt: skip
"""Every table of stored state, in an order that inserts a row after the rows it points at
(``schema_version`` is the target's own)."""


@dataclass(frozen=True, slots=True)
class TableDigest:
    """A table's row count and the SHA-256 of its rows in primary-key order."""

    rows: int
    sha256: str


class OperatorBackend(Protocol):
    """Checks, table transfer and dead-letter revival of a SQL backend."""

    name: str

    def close(self) -> None:
        """Close connections and release the writer lock."""

    def health(self) -> dict[str, Any]:
        """``backend``, ``fts`` (``ok``, ``stale``, ``unavailable``), ``available``."""

    def get_meta(self, name: str) -> str | None:
        """A ``state_meta`` value, or None."""

    def integrity_problems(self) -> list[str]:
        """Database integrity and foreign-key findings (``[]`` when sound)."""

    def fts_problems(self) -> list[str]:
        """Full-text index integrity and probe findings (``[]`` when sound or unavailable)."""

    def unreadable_rows(self) -> list[str]:
        """Routing rows and queued events the store cannot read, one line each."""

    def routing_problems(self) -> list[str]:
        """Routing rows whose session is missing or ended."""

    def writer_lock_path(self) -> str | None:
        """The writer lock file, where the lock is a file."""

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

    def prune_candidates(self, cutoff: float) -> list[str]:
        """Keys idle since before ``cutoff`` that are not suspended and have no marker."""

    def revive_queued(self, event_ids: Sequence[int]) -> int:
        """Put dead-lettered events back in their queues; how many."""

    def table_rows(
        self, name: str, after: Sequence[Any] | None, limit: int
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` rows of a table in primary-key order after the key ``after``."""

    def primary_key(self, name: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The primary key of a row of the table."""

    def insert_missing(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the rows the table lacks (by primary key), in one transaction."""

    def foreign_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """How many of ``rows`` (another store's) the table lacks or holds otherwise."""

    def set_session_counts(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Set sessions' message counts and last activity to those of ``rows``."""

    def finish_transfer(self) -> None:
        """Make a filled copy ready for use (id sequences, stale-index record)."""

    def rebuild_fts(self) -> bool:
        """Rebuild the full-text index; False when it is unavailable."""

    def table_digest(self, name: str) -> TableDigest:
        """Row count and checksum of a table."""
