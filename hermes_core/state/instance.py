"""Per-state-directory files of a running gateway: the instance lock with the boot
record, the clean-shutdown marker, the instance id and the file of stuck-loop counts; and the
lock-file primitive the instance lock and the SQLite store's one-writer lock share.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from hermes_core.domain.errors import GatewayLockedError, HermesError, StoreError
from hermes_core.domain.timeutil import format_utc, utc_now
from hermes_core.state.files import (
    atomic_write,
    create_private_file,
    ensure_private_dir,
    read_file_nofollow,
)

logger = logging.getLogger(__name__)

LOCK_FILE = "gateway.lock"
CLEAN_SHUTDOWN_FILE = ".clean_shutdown"
RESTART_COUNTS_FILE = "restart_counts.json"
INSTANCE_ID_FILE = ".instance_id"


def _json_object(raw: bytes | None) -> dict[str, Any] | None:
    """A JSON object from file bytes (BOM tolerated), or None."""
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


HOLDER_RECORD_WAIT_SECS = 1.0
"""How long a refused process waits for the lock's new holder to write its record."""


def _holder_record(fd: int) -> dict[str, Any]:
    """The record of the process holding the lock on ``fd``. A holder writes it right after
    taking the lock, so a record that is still empty, half written, or names a process of this
    host that is gone (the previous holder's) is read again for up to
    :data:`HOLDER_RECORD_WAIT_SECS`; then whatever is there is returned."""
    deadline = time.monotonic() + HOLDER_RECORD_WAIT_SECS
    while True:
        holder = _json_object(os.pread(fd, 4096, 0)) or {}
        if (holder and not _gone(holder)) or time.monotonic() >= deadline:
            return holder
        time.sleep(0.01)


def _gone(holder: Mapping[str, Any]) -> bool:
    """Whether the record names a process of this host that no longer runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by another user
        return False
    return False


class LockFile:
    """An exclusive, non-blocking ``flock`` on a file that names its holder.

    The file is opened without following symlinks (created 0600) and never replaced (that would
    drop the lock): the holder's record is rewritten in place through the locked descriptor and
    kept after exit, so the next holder reads the previous one. The operating system releases
    the lock when the process dies, however it dies.
    """

    def __init__(self, fd: int, path: Path, previous: dict[str, Any]) -> None:
        self._fd: int | None = fd
        self.path = path
        self.previous = previous
        """The record the file held before this holder wrote its own."""

    @classmethod
    def acquire(
        cls,
        path: Path,
        record: Mapping[str, Any],
        refused: Callable[[dict[str, Any]], HermesError],
    ) -> LockFile:
        """Take the lock and write ``record``; when it is held, raise ``refused(holder)``, the
        holder's record."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open the lock file {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise StoreError(f"cannot lock {path}: {exc.strerror}") from exc
            try:
                holder = _holder_record(fd)
            finally:
                os.close(fd)
            raise refused(holder) from None
        previous = _json_object(os.pread(fd, 4096, 0)) or {}
        data = json.dumps(dict(record)).encode("utf-8") + b"\n"
        os.pwrite(fd, data, 0)  # then cut what is left of a longer record: never an empty file
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return cls(fd, path, previous)

    def release(self) -> None:
        """Unlock (closing the descriptor); the record stays in the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class InstanceLock:
    """The lock on ``gateway.lock`` and this boot's record in it."""

    def __init__(self, held: LockFile, boot_id: str, previous_boot_id: str | None) -> None:
        self._held = held
        self.path = held.path
        self.boot_id = boot_id
        self.previous_boot_id = previous_boot_id

    @classmethod
    def acquire(cls, hermes_home: Path) -> InstanceLock:
        """Take the lock (raising :class:`GatewayLockedError` naming the holder's pid)."""
        ensure_private_dir(hermes_home)
        boot_id = secrets.token_hex(16)
        record = {"pid": os.getpid(), "boot_id": boot_id, "started_at": format_utc(utc_now())}

        def refused(holder: dict[str, Any]) -> HermesError:
            return GatewayLockedError(
                f"another gateway (pid {holder.get('pid', 'unknown')}) is running on "
                f"{hermes_home}; stop it first, or give this one its own HERMES_HOME."
            )

        held = LockFile.acquire(hermes_home / LOCK_FILE, record, refused)
        previous_boot = held.previous.get("boot_id")
        return cls(held, boot_id, previous_boot if isinstance(previous_boot, str) else None)

    def release(self) -> None:
        """Unlock; the boot record stays in the file."""
        self._held.release()


def lock_holder(hermes_home: Path) -> int | None:
    """The pid of a gateway holding the lock, or None when the lock is free."""
    path = hermes_home / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pid = (_json_object(os.pread(fd, 4096, 0)) or {}).get("pid")
        return pid if isinstance(pid, int) else -1
    finally:
        os.close(fd)
    return None


def write_clean_shutdown(hermes_home: Path, boot_id: str) -> None:
    """Record that this boot stopped gracefully with a drain that finished in time."""
    record = {"boot_id": boot_id, "written_at": format_utc(utc_now())}
    atomic_write(hermes_home / CLEAN_SHUTDOWN_FILE, json.dumps(record).encode("utf-8") + b"\n")


def read_clean_shutdown(hermes_home: Path, previous_boot_id: str | None) -> bool:
    """Whether ``.clean_shutdown`` proves the previous boot stopped cleanly: a
    regular file that parses and names the previous boot. A mismatch logs a warning."""
    path = hermes_home / CLEAN_SHUTDOWN_FILE
    try:
        record = _json_object(read_file_nofollow(path))
    except OSError:
        logger.warning("%s is not a regular file; treating the last stop as unclean", path)
        return False
    if record is None:
        return False
    if record.get("boot_id") != previous_boot_id or previous_boot_id is None:
        logger.warning(
            "%s belongs to another boot than the previous one; treating the last stop as unclean",
            path,
        )
        return False
    return True


def instance_id(hermes_home: Path, configured: str | None = None) -> str:
    """``gateway.instance_id`` if set, else the 32-hex id created once in ``.instance_id``."""
    if configured:
        return configured
    path = hermes_home / INSTANCE_ID_FILE
    create_private_file(path, secrets.token_hex(16).encode("ascii") + b"\n")
    raw = read_file_nofollow(path) or b""
    value = raw.decode("ascii", "replace").strip()
    if len(value) != 32 or not all(c in "0123456789abcdef" for c in value):
        raise StoreError(f"{path} does not hold a 32-hex instance id; delete it to make a new one.")
    return value


class RestartCounter(Protocol):
    """Where stuck-loop counts live: ``restart_counts.json`` on SQLite, a table on PostgreSQL."""

    def load(self) -> dict[str, int]:
        """The counts this instance keeps."""
        ...

    def save(self, counts: Mapping[str, int]) -> None:
        """Replace them, durably."""
        ...

    def remove(self, session_key: str) -> None:
        """Forget one lane's count."""
        ...


class RestartCounts:
    """Stuck-loop counts per session key in ``restart_counts.json`` (SQLite deployments).

    Loaded once and kept in memory (one gateway owns the state directory), so removing the count
    of a lane that has none costs nothing on the per-turn path.
    """

    def __init__(self, hermes_home: Path) -> None:
        self.path = hermes_home / RESTART_COUNTS_FILE
        self._counts: dict[str, int] | None = None

    def load(self) -> dict[str, int]:
        """The counts; a missing file means all zero, an unreadable one warns and reads empty."""
        if self._counts is None:
            self._counts = self._read()
        return dict(self._counts)

    def _read(self) -> dict[str, int]:
        try:
            raw = read_file_nofollow(self.path)
        except OSError:
            raw = b"{"
        if raw is None:
            return {}
        data = _json_object(raw)
        if data is None:
            logger.warning("%s is unreadable; restart counts start from zero", self.path)
            return {}
        return {
            key: value
            for key, value in data.items()
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1
        }

    def save(self, counts: Mapping[str, int]) -> None:
        """Write atomically; an empty map deletes the file."""
        if counts:
            body = json.dumps(dict(sorted(counts.items())), indent=2) + "\n"
            atomic_write(self.path, body.encode("utf-8"))
        else:
            self.path.unlink(missing_ok=True)
        self._counts = dict(counts)

    def remove(self, session_key: str) -> None:
        """Forget one lane's count (a successful turn, a reset or a suspension replacement)."""
        counts = self.load()
        if counts.pop(session_key, None) is not None:
            self.save(counts)
