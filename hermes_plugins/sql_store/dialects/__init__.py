"""What differs between SQLite and PostgreSQL in the SQL store, one object per database kind.

In the manner of SQLAlchemy's dialects: a store picks its dialect once, when it opens
(:func:`dialect_for`), and its parts ask it (declared flags, the few statements and steps that
differ) instead of comparing names.
"""

from __future__ import annotations

from hermes_core.domain.errors import StoreUnavailableError
from hermes_plugins.sql_store.dialects.base import Dialect
from hermes_plugins.sql_store.dialects.postgresql import PostgresqlDialect
from hermes_plugins.sql_store.dialects.sqlite import SqliteDialect

__all__ = ["Dialect", "dialect_for"]

_DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect for dialect in (SqliteDialect(), PostgresqlDialect())
}


def dialect_for(name: str) -> Dialect:
    """The dialect of a database URL (``sqlite:///...``, ``postgresql+psycopg://...``) or of a
    name (a URL's backend name, a SQLAlchemy dialect's ``name``)."""
    backend = name.partition(":")[0].partition("+")[0]
    try:
        return _DIALECTS[backend]
    except KeyError:
        raise StoreUnavailableError(
            f"the SQL store knows no database {backend!r}; use a sqlite:// or postgresql:// URL."
        ) from None
