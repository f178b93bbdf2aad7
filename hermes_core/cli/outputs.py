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

A file (one that exists, or a new name) is written as ``.NAME.partial`` beside it and renamed onto
it once complete (:func:`written_output`): an export interrupted, killed or out of disk space
leaves the file as it was (or absent), never a truncated file that looks complete; the next run
replaces the partial file it left.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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
_PARTIAL_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


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


def _cannot_write(path: Path, exc: OSError) -> InvalidValueError:
    reason = exc.strerror or type(exc).__name__
    if exc.errno == errno.ENXIO:
        reason = "nothing reads from it (a FIFO without a reader); start its reader first"
    return InvalidValueError("output", f"{shown(str(path))}: cannot write: {reason}.")


@contextmanager
def written_output(path: Path, config: GatewayConfig) -> Iterator[TextIO]:
    """``path`` open for writing text, after :func:`refuse_store_file`: a file is written beside
    it and renamed onto it when the block ends without an error (see the module), a device or
    pipe is written in place."""
    refuse_store_file(path, config, "output")
    target = Path(os.path.realpath(path))  # a symlink's file is replaced, not the symlink
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    if info is not None and not stat.S_ISREG(info.st_mode):
        with _open_in_place(path, config) as out:
            yield out
        return
    partial = target.with_name(f".{target.name}.partial")
    with suppress(FileNotFoundError):
        partial.unlink()  # what an interrupted run left
    try:
        out = os.fdopen(os.open(partial, _PARTIAL_FLAGS, 0o600), "w", encoding="utf-8")
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        with out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        refuse_store_file(target, config, "output")  # nothing linked a store file there since
        os.replace(partial, target)
    except BaseException:
        with suppress(OSError):
            partial.unlink()
        raise


def _open_in_place(path: Path, config: GatewayConfig) -> TextIO:
    """``path`` itself opened for writing text (a character device or a pipe)."""
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o600)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):  # a file put there since: written as one
            raise InvalidValueError(
                "output", f"{shown(str(path))}: cannot write: it became a file while the export "
                "started; run it again."
            )  # fmt: skip
        if not (stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
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
