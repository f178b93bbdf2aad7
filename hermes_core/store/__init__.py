"""Session storage: the :class:`SessionStore` and the backend contract plugins implement."""

from __future__ import annotations

from hermes_core.store.backend import (
    CounterDelta,
    DurableQueue,
    LedgerRows,
    Maintenance,
    Pruning,
    RestartCountRows,
    SearchCapable,
    SearchHit,
    SessionRow,
    StoreBackend,
    TranscriptEditing,
)
from hermes_core.store.session_store import SessionStore
from hermes_core.store.turns import MarkerRecovery

__all__ = [
    "CounterDelta",
    "DurableQueue",
    "LedgerRows",
    "Maintenance",
    "MarkerRecovery",
    "Pruning",
    "RestartCountRows",
    "SearchCapable",
    "SearchHit",
    "SessionRow",
    "SessionStore",
    "StoreBackend",
    "TranscriptEditing",
]
