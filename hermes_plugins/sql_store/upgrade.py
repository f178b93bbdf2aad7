"""Creating, upgrading and checking the schema of a SQL store when it opens.

Only the holder of the writer lock creates or upgrades the schema (on a shared store, under a
transaction-level advisory lock instead), in one transaction that reads the version first, so
processes starting together never do it twice. A store opened read-only only checks that the
schema is there, at this release's version.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection, delete, func, insert, select

from hermes_core.domain.errors import SchemaVersionError, StoreUnavailableError
from hermes_plugins.sql_store.dialects import Dialect
from hermes_plugins.sql_store.schema import MIGRATIONS, SCHEMA_VERSION, schema_version

logger = logging.getLogger(__name__)


def stored_version(conn: Connection, display: str) -> int:
    """The database's schema version (0: no schema yet); a newer one than this release knows
    is refused."""
    current = 0
    if "schema_version" in set(conn.dialect.get_table_names(conn)):
        found = conn.execute(select(func.max(schema_version.c.version))).scalar()
        current = int(found or 0)
    if current > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{display}: the database has schema version {current}, newer than "
            f"version {SCHEMA_VERSION} supported by this hermes-sessions; upgrade "
            "hermes-sessions (the database was left untouched)."
        )
    return current


def check_schema(conn: Connection, display: str) -> None:
    """Read-only: the schema must be there already, at this release's version."""
    current = stored_version(conn, display)
    conn.rollback()
    if current == 0:
        raise StoreUnavailableError(
            f"{display}: the database has no hermes-sessions schema yet, so there is "
            "nothing to read; a store opened for writing (the gateway) creates it."
        )
    if current < SCHEMA_VERSION:
        raise StoreUnavailableError(
            f"{display}: the database has schema version {current}, older than version "
            f"{SCHEMA_VERSION} of this hermes-sessions; open it for writing once (start the "
            "gateway) to upgrade it, then read it."
        )


def migrate(conn: Connection, dialect: Dialect, display: str, *, shared: bool) -> None:
    """Create or upgrade the schema in one transaction; refuse a newer schema."""
    dialect.begin_migration(conn, shared=shared)
    try:
        current = stored_version(conn, display)
        for step in MIGRATIONS[current:]:
            step(conn, dialect)
        if current < SCHEMA_VERSION:
            conn.execute(delete(schema_version))
            conn.execute(insert(schema_version).values(version=SCHEMA_VERSION))
            if current:
                logger.warning(
                    "%s: upgraded the schema from version %d to %d",
                    display, current, SCHEMA_VERSION,
                )  # fmt: skip
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
