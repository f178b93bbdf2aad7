"""One writer per database: the lock a SQL store holds for as long as it may write.

SQLite: an exclusive ``flock`` on ``<database>.lock`` beside the database file (the lock-file
primitive of the gateway's own instance lock), holding the writer's identity as JSON.
PostgreSQL: a session-level advisory lock (:data:`LOCK_KEYS`) held by the writer's connection
itself, so the lock and the writes share one fate: if the connection is lost, so is the lock,
and the store takes it again before it writes on a new connection. Every connection of a store
carries the writer's identity as ``application_name``, which a refused writer reads back.

Either lock is released by the operating system or the server when the process dies.
"""

from __future__ import annotations

import os
import socket
import zlib
from pathlib import Path
from typing import Any

from hermes_core.config import GatewayConfig
from hermes_core.errors import GatewayLockedError, HermesError
from hermes_core.instance import LockFile
from hermes_core.timeutil import format_utc, utc_now

LOCK_SUFFIX = ".lock"
"""The SQLite lock file is the database's path with this suffix (``state.db.lock``)."""

LOCK_KEYS = (zlib.crc32(b"hermes-sessions") & 0x7FFFFFFF, 1)
"""The two-integer key of PostgreSQL's writer lock (advisory locks are per database)."""

_APPLICATION_NAME_MAX = 63
"""PostgreSQL truncates ``application_name`` to this many bytes."""


def identity(config: GatewayConfig) -> dict[str, Any]:
    """Who writes: process id, host and state directory (a refused writer is told these)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "home": str(config.hermes_home)}


def describe(holder: dict[str, Any]) -> str:
    """A holder's identity in words, e.g. ``pid 4242 on host gw1, HERMES_HOME /srv/hermes``."""
    words = f"pid {holder.get('pid', 'unknown')}"
    if holder.get("host"):
        words += f" on host {holder['host']}"
    if holder.get("home"):
        words += f", HERMES_HOME {holder['home']}"
    return words


def _refusal(display: str, holder: str) -> GatewayLockedError:
    return GatewayLockedError(
        f"another writer ({holder}) holds the store {display}; one process may write to a "
        "database at a time: stop that one first, give this one its own database, or open the "
        "store read-only (SessionStore(..., read_only=True)) to read."
    )


def lock_sqlite(database: Path, display: str, config: GatewayConfig) -> LockFile:
    """Take ``<database>.lock``, or raise :class:`GatewayLockedError` naming the holder."""
    record = identity(config) | {"started_at": format_utc(utc_now())}

    def refused(holder: dict[str, Any]) -> HermesError:
        return _refusal(display, describe(holder))

    return LockFile.acquire(Path(f"{database}{LOCK_SUFFIX}"), record, refused)


def application_name(config: GatewayConfig) -> str:
    """``application_name`` of a store's PostgreSQL connections: the identity, shortened."""
    who = identity(config)
    name = f"hermes-sessions pid={who['pid']} host={who['host']}"
    return name.encode("utf-8")[:_APPLICATION_NAME_MAX].decode("utf-8", "ignore")


TRY_LOCK = f"SELECT pg_try_advisory_lock({LOCK_KEYS[0]}, {LOCK_KEYS[1]})"
"""Take the writer lock on this session; returns whether it was free."""

MIGRATION_LOCK = f"SELECT pg_advisory_xact_lock({LOCK_KEYS[0]}, 2)"
"""Shared mode: schema creation and upgrades wait for each other (released at commit)."""

UNLOCK = f"SELECT pg_advisory_unlock({LOCK_KEYS[0]}, {LOCK_KEYS[1]})"
"""Release the writer lock at once (a closed session's locks end only once the server notices)."""

HOLDER = f"""
SELECT a.application_name, host(a.client_addr), a.pid
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.classid = {LOCK_KEYS[0]} AND l.objid = {LOCK_KEYS[1]}
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
"""Who holds the writer lock: (application name, client address, server process id)."""


def lock_postgres(cursor: Any, display: str) -> None:
    """Take the writer lock on the session of ``cursor`` (the writer's own connection), or
    raise :class:`GatewayLockedError` naming the holder."""
    cursor.execute(TRY_LOCK)
    if cursor.fetchone()[0]:
        return
    cursor.execute(HOLDER)
    row = cursor.fetchone()
    if row is None:  # released between the two statements: say so rather than guess
        raise _refusal(display, "a process that has just stopped; try again")
    name, address, backend = row
    where = f" from {address}" if address else ""
    raise _refusal(display, f"{name or 'unnamed'}{where}, server process {backend}")
