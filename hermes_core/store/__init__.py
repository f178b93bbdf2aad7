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

__all__ = [
    "CounterDelta",
    "SearchHit",
    "SessionRow",
    "SessionStore",
    "SqlMaintenance",
    "StoreBackend",
]
