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
from hermes_core.errors import ConfigError, GatewayLockedError, HermesError
from hermes_core.instance import LockFile, instance_id
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
    """``application_name`` of a store's PostgreSQL connections: the identity, shortened; in
    shared mode the instance id comes first, so an operator tells the gateways apart."""
    who = identity(config)
    name = f"hermes-sessions pid={who['pid']} host={who['host']}"
    if config.storage.instances == "shared":
        name = f"hermes {instance_id(config.hermes_home, config.gateway.instance_id)} " + name
    return name.encode("utf-8")[:_APPLICATION_NAME_MAX].decode("utf-8", "ignore")


CONNECTION_LIMITS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int
       + coalesce(current_setting('reserved_connections', true)::int, 0),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int
"""
"""The server's connection limit, the slots reserved for superusers and roles, and the client
connections open now."""


def check_connections(
    display: str, need: int, limits: tuple[int, int, int], *, ours: int
) -> str | None:
    """Compare the connections a process needs with the server's ``(max_connections,
    reserved, in use)``: raise :class:`ConfigError` if they can never fit; return a warning
    when they do not fit beside the connections open now (other processes may close theirs),
    else None. ``ours``: how many of those in use this process has opened already."""
    limit, reserved, in_use = limits
    usable = limit - reserved
    if need > usable:
        raise ConfigError(
            "storage.read_connections",
            f"{display}: this gateway needs {need} connections (1 writer + "
            f"{need - 1} readers, storage.read_connections), but the server allows "
            f"{usable} ({limit} max_connections, {reserved} reserved); lower "
            "storage.read_connections or raise the server's max_connections.",
        )
    free = usable - (in_use - ours)
    if need > free:
        return (
            f"{display}: this gateway may need {need} connections (1 writer + {need - 1} "
            f"readers) but only {free} of the server's {usable} are free now ({in_use - ours} "
            "open elsewhere); reads will fail when the server runs out: lower "
            "storage.read_connections or raise max_connections."
        )
    return None


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
