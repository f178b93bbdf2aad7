"""Session storage: the :class:`SessionStore` and the backend contract plugins implement."""

from __future__ import annotations

from hermes_core.store.backend import (
    CounterDelta,
    SearchHit,
    SessionRow,
    SqlMaintenance,
    StoreBackend,
)
from hermes_core.store.session_store import SessionStore
from hermes_core.store.turns import MarkerRecovery

__all__ = [
    "CounterDelta",
    "MarkerRecovery",
    "SearchHit",
    "SessionRow",
    "SessionStore",
    "SqlMaintenance",
    "StoreBackend",
]
