"""Built-in SQL storage: SQLite (the default) and PostgreSQL through SQLAlchemy Core.

SQLAlchemy is imported only when a store is opened, so key building stays light.
"""

from __future__ import annotations

from typing import Any

from hermes_core import GatewayConfig, StoreSpec, hookimpl
from hermes_core.domain.specs import StoreCapability


def open_sql_backend(url: str, config: GatewayConfig) -> Any:
    """Open the SQL backend for ``url`` for writing, taking the database's writer lock
    (imported on first use)."""
    from hermes_plugins.sql_store.backend import SqlBackend

    return SqlBackend(url, config)


def open_sql_backend_read_only(url: str, config: GatewayConfig) -> Any:
    """Open the SQL backend for ``url`` to read only (no lock; writes refused)."""
    from hermes_plugins.sql_store.backend import SqlBackend

    return SqlBackend(url, config, read_only=True)


_LOCAL: frozenset[StoreCapability] = frozenset(
    {"search", "transcript_edits", "pruning", "ledger", "queue", "maintenance"}
)
"""What SQLite offers: everything but restart counts, which stay in the instance's own file."""


@hookimpl
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """``sqlite`` (a local file: JSONL fallback, sessions.json mirror) and ``postgresql``
    (psycopg 3; restart counts in the database, tagged per instance); every write batch atomic.
    One writer per database, except PostgreSQL with ``storage.instances: shared``, where
    gateways share the database under turn leases."""
    common: dict[str, Any] = {
        "open": open_sql_backend, "open_read_only": open_sql_backend_read_only,
        "atomic_batches": True,
    }  # fmt: skip
    shared = config.storage.instances == "shared"
    return [
        StoreSpec(
            name="sqlite", schemes=("sqlite", "sqlite+pysqlite"), capabilities=_LOCAL,
            local=True, single_instance=True, **common,
        ),
        StoreSpec(
            name="postgresql", schemes=("postgresql", "postgresql+psycopg"),
            capabilities=_LOCAL | {"restart_counts"}, single_instance=not shared,
            parallel_writers=True, lane_wakeups=shared, **common,
        ),
    ]  # fmt: skip
