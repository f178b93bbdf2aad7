"""Built-in SQL storage: SQLite (the default) and PostgreSQL through SQLAlchemy Core.

SQLAlchemy is imported only when a store is opened, so key building stays light.
"""

from __future__ import annotations

from pathlib import Path
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


def sqlite_files(url: str) -> list[Path]:
    """The files of the SQLite database a URL names: the database, its journals and the
    writer lock (none for a URL without a path)."""
    from hermes_plugins.sql_store.exclusive import LOCK_SUFFIX

    if ":///" not in url:
        return []
    database = url.split(":///", 1)[1]
    return [Path(f"{database}{suffix}") for suffix in ("", "-wal", "-shm", "-journal", LOCK_SUFFIX)]


_BOTH: frozenset[StoreCapability] = frozenset(
    {"search", "transcript_edits", "pruning", "ledger", "queue", "maintenance", "atomic_batches",
     "operator", "route_batches"}
)  # fmt: skip
"""What both backends offer. SQLite keeps restart counts in the instance's own file;
PostgreSQL keeps them, commits on several writer connections and, in shared mode, has turn
leases and lane wake-ups."""


@hookimpl
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """``sqlite`` (a local file: JSONL fallback, sessions.json mirror) and ``postgresql``
    (psycopg 3; restart counts in the database, tagged per instance; parallel writers).
    One writer per database, except PostgreSQL with ``storage.instances: shared``, where
    gateways share the database under turn leases and wake each other's lanes."""
    opens: dict[str, Any] = {
        "open": open_sql_backend, "open_read_only": open_sql_backend_read_only,
    }  # fmt: skip
    shared: list[StoreCapability] = (
        ["turn_leases", "lane_wakeups"] if config.storage.instances == "shared" else []
    )
    return [
        StoreSpec(
            name="sqlite", schemes=("sqlite", "sqlite+pysqlite"),
            capabilities=[*_BOTH, "local_state"], files=sqlite_files, **opens,
        ),
        StoreSpec(
            name="postgresql", schemes=("postgresql", "postgresql+psycopg"),
            capabilities=[*_BOTH, "restart_counts", "parallel_writers", *shared], **opens,
        ),
    ]  # fmt: skip
