"""Built-in SQL storage: SQLite (the default) and PostgreSQL through SQLAlchemy Core.

SQLAlchemy is imported only when a store is opened, so key building stays light.
"""

from __future__ import annotations

from typing import Any

from hermes_core import GatewayConfig, StoreSpec, hookimpl


def open_sql_backend(url: str, config: GatewayConfig) -> Any:
    """Open the SQL backend for ``url`` (imported on first use)."""
    from hermes_plugins.sql_store.backend import SqlBackend

    return SqlBackend(url, config)


@hookimpl
def hermes_register_stores(config: GatewayConfig) -> list[StoreSpec]:
    """``sqlite`` (one gateway per state directory) and ``postgresql`` (psycopg 3)."""
    return [
        StoreSpec(name="sqlite", schemes=("sqlite", "sqlite+pysqlite"), open=open_sql_backend),
        StoreSpec(
            name="postgresql", schemes=("postgresql", "postgresql+psycopg"), open=open_sql_backend
        ),
    ]
