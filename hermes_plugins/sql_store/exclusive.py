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

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import ConfigError, GatewayLockedError, HermesError
from hermes_core.domain.timeutil import format_utc, utc_now
from hermes_core.state.instance import LockFile, instance_id

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
    situation = f"another writer ({holder}) holds the store {display}"
    return GatewayLockedError(
        f"{situation}; one process may write to a database at a time: stop that one first, give "
        "this one its own database, or open the store read-only (SessionStore(..., "
        "read_only=True)) to read.",
        situation=situation,
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
    display: str,
    writers: int,
    readers: int,
    limits: tuple[int, int, int],
    *,
    ours: int,
    listening: bool = False,
) -> str | None:
    """Compare the connections a process needs (``writers + readers``, plus one that listens
    for lane wake-ups on a shared store) with the server's ``(max_connections, reserved, in
    use)``: raise :class:`ConfigError` if they can never fit; return a warning when they do not
    fit beside the connections open now (other processes may close theirs), else None.
    ``ours``: how many of those in use this process opened already."""
    limit, reserved, in_use = limits
    need, usable, elsewhere = writers + readers + listening, limit - reserved, in_use - ours
    needs = (
        f"{need} connections ({writers} writers, storage.writer_connections, {readers} "
        "readers, storage.read_connections"
        + (", and 1 listening for lane wake-ups)" if listening else ")")
    )
    if need > usable:
        raise ConfigError(
            "storage.read_connections",
            f"{display}: this gateway needs {needs}, but the server allows {usable} ({limit} "
            f"max_connections, {reserved} reserved); lower those settings or raise the "
            "server's max_connections.",
        )
    if need > usable - elsewhere:
        return (
            f"{display}: this gateway may need {needs}, but only {usable - elsewhere} of the "
            f"server's {usable} are free now ({elsewhere} open elsewhere); connections fail "
            "once the server runs out: lower those settings or raise max_connections."
        )
    return None


_KEY = f"{LOCK_KEYS[0]}, {LOCK_KEYS[1]}"

TRY_LOCK = f"SELECT pg_try_advisory_lock({_KEY})"
"""Take the writer lock alone on this session; returns whether nobody held it."""

SHARE_LOCK = f"SELECT pg_advisory_lock_shared({_KEY})"
"""Keep a shared hold of the writer lock (the first connection, which holds it alone)."""

JOIN_LOCK = f"SELECT pg_try_advisory_lock_shared({_KEY})"
"""Hold the writer lock beside the store's other writer connections; false while a starting
writer holds it alone."""

MIGRATION_LOCK = f"SELECT pg_advisory_xact_lock({LOCK_KEYS[0]}, 2)"
"""Shared mode: schema creation and upgrades wait for each other (released at commit)."""

UNLOCK = f"SELECT pg_advisory_unlock({_KEY})"
"""Release the lone hold of the writer lock (the first connection keeps its shared one)."""

UNLOCK_SHARED = f"SELECT pg_advisory_unlock_shared({_KEY})"
"""Release a writer connection's hold at once (a closed session's locks end only once the
server notices, and the next writer may be starting already)."""

HOLDER = f"""
SELECT a.application_name, host(a.client_addr), a.pid
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.classid = {LOCK_KEYS[0]} AND l.objid = {LOCK_KEYS[1]}
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND NOT (l.pid = ANY(%(ours)s))
"""
"""Who else holds the writer lock: (application name, client address, server process id)."""


def lock_postgres(cursor: Any, display: str, *, first: bool, ours: set[int]) -> None:
    """Make the session of ``cursor`` (a writer connection) hold the writer lock, or raise
    :class:`GatewayLockedError` naming the holder.

    Every writer connection of a store holds the lock shared. ``first``: the store's first
    connection takes it alone first, which succeeds only if no connection of any other
    process holds it, then keeps a shared hold. A later connection joins with a shared hold
    and checks that only ``ours`` (the store's connections, server process ids) hold it:
    otherwise another process became the writer while this store's connections were lost.
    """
    if first:
        cursor.execute(TRY_LOCK)
        if cursor.fetchone()[0]:
            cursor.execute(SHARE_LOCK)  # granted at once: the session holds the lock already
            cursor.execute(UNLOCK)
            return
        joined = False
    else:
        cursor.execute(JOIN_LOCK)
        joined = bool(cursor.fetchone()[0])
    cursor.execute(HOLDER, {"ours": sorted(ours)})
    row = cursor.fetchone()
    if joined and row is None:
        return
    if joined:
        cursor.execute(UNLOCK_SHARED)
    if row is None:  # released between the two statements: say so rather than guess
        raise _refusal(display, "a process that has just stopped; try again")
    name, address, backend = row
    where = f" from {address}" if address else ""
    raise _refusal(display, f"{name or 'unnamed'}{where}, server process {backend}")
