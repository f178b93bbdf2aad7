"""Where operator commands write files, and how: never onto the store they work on.

``export --output FILE`` and ``migrate --to sqlite:///FILE`` name paths. A path that leads, as it
is, through a symlink or as a hard link, to one of the store's own files is refused before
anything is opened for writing: the files its ``StoreSpec.files`` declares (a SQLite database
and its ``-wal``, ``-shm``, ``-journal`` and ``.lock`` files), anything in the sessions
directory (``sessions.json``, the degraded-mode transcripts), the gateway's lock, counter,
clean-shutdown and instance-id files, the PII key and the configuration. Truncating one of them
would empty the store, or a running gateway's write-ahead log.

An output is opened after the store (so a store that cannot be opened leaves no file behind),
created 0600 like the store's own files, and opened without blocking: a FIFO that nothing reads
is refused instead of hanging. A regular file, a character device (``/dev/null``, a terminal) and
a pipe with a reader (``-o >(gzip > export.gz)``) are accepted; anything else is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import TextIO

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, shown
from hermes_core.plugins.manager import HermesPluginManager, default_plugin_manager
from hermes_core.state.instance import (
    CLEAN_SHUTDOWN_FILE,
    INSTANCE_ID_FILE,
    LOCK_FILE,
    RESTART_COUNTS_FILE,
)

PRIVATE_FILES = (LOCK_FILE, CLEAN_SHUTDOWN_FILE, RESTART_COUNTS_FILE, INSTANCE_ID_FILE)
"""The gateway's own files in its state directory."""
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def backend_files(config: GatewayConfig, plugins: HermesPluginManager | None = None) -> list[Path]:
    """The files of the store ``storage.url`` names, as its ``StoreSpec.files`` declares them
    (none when no plugin serves the scheme): a SQLite database, its journals and its lock."""
    scheme = config.storage_url.split("://", 1)[0]
    spec = (plugins or default_plugin_manager(config)).stores().get(scheme)
    return [] if spec is None or spec.files is None else list(spec.files(config.storage_url))


def gateway_files(config: GatewayConfig) -> list[Path]:
    """The gateway's own files in its state directory and the PII key."""
    return [config.hermes_home / name for name in PRIVATE_FILES] + [config.pii_hmac_key_file]


def store_files(config: GatewayConfig, plugins: HermesPluginManager | None = None) -> list[Path]:
    """The store's own files outside the sessions directory, whether they exist or not."""
    return gateway_files(config) + backend_files(config, plugins)


def _identity(path: Path) -> tuple[int, int] | None:
    """Device and inode of what ``path`` leads to (None when nothing is there)."""
    try:
        info = path.stat()
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _protected(config: GatewayConfig) -> tuple[set[Path], Path, set[tuple[int, int]]]:
    """The store's files resolved, its sessions directory resolved, and the identities of those
    that exist (so a hard link to one of them is recognised too)."""
    files = [*store_files(config), config.hermes_home / "config.yaml"]
    if config.source and Path(config.source).is_file():
        files.append(Path(config.source))
    sessions = config.sessions_dir.resolve()
    inside = sorted(sessions.iterdir()) if sessions.is_dir() else []
    identities = {found for path in [*files, *inside] if (found := _identity(path))}
    return {path.resolve() for path in files}, sessions, identities


def refuse_store_file(path: Path, config: GatewayConfig, what: str) -> None:
    """Raise :class:`InvalidValueError` (field ``what``) when ``path`` is, or leads to, one of
    the files of the store of ``config``."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL
        raise InvalidValueError(what, f"{shown(str(path))}: cannot be used: {exc}") from exc
    files, sessions, identities = _protected(config)
    if (
        resolved in files
        or resolved == sessions
        or sessions in resolved.parents
        or _identity(path) in identities
    ):
        raise InvalidValueError(
            what,
            f"{shown(str(path))} is one of the store's own files (or leads to one): writing it "
            "would destroy stored state; name a file outside the store's files and its sessions "
            "directory.",
        )


def open_output(path: Path, config: GatewayConfig) -> TextIO:
    """``path`` opened for writing text, after :func:`refuse_store_file`; see the module."""
    refuse_store_file(path, config, "output")
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o600)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno == errno.ENXIO:
            reason = "nothing reads from it (a FIFO without a reader); start its reader first"
        raise InvalidValueError("output", f"{shown(str(path))}: cannot write: {reason}.") from exc
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            if (info.st_dev, info.st_ino) in _protected(config)[2]:  # linked there meanwhile
                refuse_store_file(path, config, "output")
            os.ftruncate(fd, 0)
        elif not (stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
            raise InvalidValueError(
                "output",
                f"{shown(str(path))}: cannot write: not a regular file, a character device or a "
                "pipe; name a file.",
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise
