"""Built-in SQL storage: SQLite (the default) and PostgreSQL through SQLAlchemy Core.

SQLAlchemy is imported only when a store is opened, so key building stays light.
"""

from __future__ import annotations

from typing import Any

from hermes_core import GatewayConfig, StoreSpec, hookimpl


def open_sql_backend(url: str, config: GatewayConfig) -> Any:
    """Open the SQL backend for ``url`` for writing, taking the database's writer lock
    (imported on first use)."""
    from hermes_plugins.sql_store.backend import SqlBackend

    return SqlBackend(url, config)


def open_sql_backend_read_only(url: str, config: GatewayConfig) -> Any:
    """Open the SQL backend for ``url`` to read only (no lock; writes refused)."""
    from hermes_plugins.sql_store.backend import SqlBackend

    return SqlBackend(url, config, read_only=True)


@hookimpl
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """``sqlite`` and ``postgresql`` (psycopg 3); one writer per database for both."""
    return [
        StoreSpec(
            name=name,
            schemes=schemes,
            open=open_sql_backend,
            open_read_only=open_sql_backend_read_only,
        )
        for name, schemes in (
            ("sqlite", ("sqlite", "sqlite+pysqlite")),
            ("postgresql", ("postgresql", "postgresql+psycopg")),
        )
    ]
