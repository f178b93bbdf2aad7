"""Secure file primitives for everything the library writes to disk, and the bounded read of a
file a user names (a configuration, a payload).

Files are created with their final mode (0600 files, 0700 directories), never widened and then
chmod-ed; write targets are checked with ``lstat`` so a symlink or special file planted in the
state directory is refused rather than followed. Durability takes three forms: the
atomic procedure (temp file, fsync, replace, fsync the directory), exclusive create, and fsynced
appends. A failed fsync is never retried: the data it covered is treated as lost.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, AnyStr

from hermes_core.domain.errors import InvalidValueError, StoreError, TranscriptWriteError, shown

logger = logging.getLogger(__name__)

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# O_NONBLOCK only matters for a FIFO planted in place of a file: opening it fails instead of
# hanging. Reads and writes of regular files ignore it.
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_NOFOLLOW | _O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
# Errors meaning "this file system cannot fsync a directory", not "the data is lost".
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF})


def _reason(exc: OSError) -> str:
    """The operating system's reason, without repeating the path."""
    return exc.strerror or type(exc).__name__


def fsync_dir(path: Path) -> None:
    """Make a create, rename or unlink inside ``path`` durable.

    A no-op where directories cannot be opened or fsynced (Windows, some network file systems);
    any other failure raises :class:`OSError`.
    """
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


_WRITE_BUFFER = 1 << 20
"""Bytes gathered from a stream of small chunks before one ``write`` call."""


def _fill(fd: int, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` completely (in writes of about :data:`_WRITE_BUFFER` bytes; a file may
    take each in several pieces), fsync, close ``fd``. Only one buffer is held at a time."""

    def flush(data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    try:
        buffer = bytearray()
        for chunk in chunks:
            buffer += chunk
            if len(buffer) >= _WRITE_BUFFER:
                flush(buffer)
                buffer.clear()
        flush(buffer)
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    """Remove a temp file we created; it may already be gone."""
    try:
        os.unlink(path)
    except OSError:
        return


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` and missing parents with mode 0700; returns ``path``.

    An existing directory is kept as it is (a symlink to a directory is accepted, as
    ``$HERMES_HOME`` may be one); if group or others can access it, one warning names it. A path
    that exists but is not a directory raises :class:`StoreError`.
    """
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue  # created concurrently; checked below like any existing directory
        except OSError as exc:
            raise StoreError(
                f"cannot create directory {directory}: {_reason(exc)}; create it yourself (mode "
                "0700) or configure a state directory this user can write."
            ) from exc
    try:
        info = os.stat(path)
    except OSError as exc:
        raise StoreError(
            f"cannot use {path} as a directory: {_reason(exc)}; fix or remove it (a dangling "
            "symlink is a common cause)."
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise StoreError(
            f"{path} exists but is not a directory; move it away or configure another directory."
        )
    if info.st_mode & 0o077:
        # A directory of ours can be tightened; a shared one (/tmp: another owner, sticky bit)
        # must not be, so the advice is then a directory of the state's own inside it.
        ours = info.st_uid == os.getuid() and not info.st_mode & stat.S_ISVTX
        advice = (
            f"run 'chmod 700 {path}'"
            if ours
            else f"keep the state in a directory of its own (mode 0700) inside {path}"
        )
        logger.warning(
            "directory %s is accessible by group or others (mode %03o); %s to keep session "
            "state private",
            path,
            stat.S_IMODE(info.st_mode),
            advice,
        )
    return path


def refuse_special_target(path: Path) -> None:
    """Raise :class:`StoreError` if ``path`` exists as a symlink or non-regular file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreError(f"cannot inspect {path}: {_reason(exc)}.") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise StoreError(
            f"refusing to write {path}: it is a symlink or not a regular file; remove it so "
            "hermes-sessions can create a regular file there."
        )


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see :func:`atomic_write_stream`)."""
    atomic_write_stream(path, (data,))


def atomic_write_stream(
    path: Path, chunks: Iterable[bytes], commit: AbstractContextManager[bool] | None = None
) -> bool:
    """Replace ``path`` with the concatenated ``chunks`` atomically and durably, holding only
    a bounded buffer of them at a time (a file of any size, streamed from an iterator).

    A 0600 temp file in the same directory is written, fsynced and renamed over ``path``; then
    the directory is fsynced. The rename happens inside ``commit`` (when given), and only if it
    yields True: a caller's lock and last check; otherwise the temp file is discarded and False
    returned. An exception raised by ``chunks`` also discards it and propagates. On any failure
    of the file system the temp file is removed, the old file is kept (the rename is the last
    step that can lose it) and :class:`StoreError` is raised, chained to the :class:`OSError`.
    """
    refuse_special_target(path)
    directory = path.parent
    temp = directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(temp, _CREATE_FLAGS, 0o600)
    except OSError as exc:
        raise StoreError(
            f"cannot write {path}: creating a temporary file in {directory} failed "
            f"({_reason(exc)}); check that the directory exists and is writable."
        ) from exc
    try:
        _fill(fd, chunks)
        with commit if commit is not None else nullcontext(True) as wanted:
            if wanted:
                os.replace(temp, path)
        if not wanted:
            _unlink_quietly(temp)
            return False
    except OSError as exc:
        _unlink_quietly(temp)
        raise StoreError(
            f"cannot write {path}: {_reason(exc)}; the previous version is kept. Check free "
            "space and permissions."
        ) from exc
    except BaseException:
        _unlink_quietly(temp)
        raise
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise StoreError(
            f"wrote {path} but could not make its directory durable: {_reason(exc)}; the new "
            "version may not survive a power loss. Check the file system."
        ) from exc
    return True


def create_private_file(path: Path, data: bytes) -> bool:
    """Create ``path`` (mode 0600) holding ``data``, durably; False if it already exists.

    Exclusive create, write, fsync the file and the directory, so a file that exists
    is always complete: a failed write removes it again and raises :class:`StoreError`. An
    existing symlink or non-regular file at ``path`` raises :class:`StoreError` instead of
    returning False, so callers never go on to read through a planted link.
    """
    try:
        fd = os.open(path, _CREATE_FLAGS, 0o600)
    except FileExistsError:
        refuse_special_target(path)
        return False
    except OSError as exc:
        raise StoreError(
            f"cannot create {path}: {_reason(exc)}; check that its directory exists and is "
            "writable."
        ) from exc
    try:
        _fill(fd, (data,))
    except OSError as exc:
        _unlink_quietly(path)
        raise StoreError(
            f"cannot write {path}: {_reason(exc)}; check free space and permissions."
        ) from exc
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        raise StoreError(
            f"created {path} but could not make its directory durable: {_reason(exc)}."
        ) from exc
    return True


def read_file_nofollow(path: Path) -> bytes | None:
    """The content of the regular file ``path``, opened without following a symlink.

    None if it does not exist. A symlink, a special file or a read failure raises
    :class:`OSError` (callers turn it into their own error).
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return handle.read()


def read_user_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The content of the file ``path`` that a user named (a symlink to it is followed), at
    most ``limit`` bytes.

    It is opened without blocking and must be a regular file, so a FIFO is refused instead of
    waited on and a device such as ``/dev/zero`` instead of read for ever. A missing file raises
    :class:`FileNotFoundError`; a special file, a larger file or a read failure another
    :class:`OSError` whose ``strerror`` says why (callers turn it into their own error).
    """
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a directory, FIFO or device)")
        return read_at_most(handle, limit)


def read_at_most(stream: IO[AnyStr], limit: int) -> AnyStr:
    """All of ``stream`` when it holds at most ``limit`` bytes (characters, for a text stream);
    else :class:`OSError` (``EFBIG``) without reading further."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes")
    return data


def append_line_durably(path: Path, line: bytes) -> None:
    """Append one complete line (including its newline) to ``path`` and fsync it.

    Opened append-only without following symlinks (0600 when created); the line goes out in one
    ``write`` so concurrent readers never see two lines interleaved. A new file's directory entry
    is fsynced as well. Any failure raises :class:`TranscriptWriteError`: the line must then be
    considered not stored.
    """
    try:
        created = not os.path.lexists(path)
        if not created:
            refuse_special_target(path)
        fd = os.open(path, _APPEND_FLAGS, 0o600)
    except StoreError as exc:
        raise TranscriptWriteError(str(exc)) from exc
    except OSError as exc:
        hint = " (it is a symlink; remove it)" if exc.errno == errno.ELOOP else ""
        raise TranscriptWriteError(
            f"cannot append to {path}: {_reason(exc)}{hint}; check the file and its directory."
        ) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TranscriptWriteError(
                f"refusing to append to {path}: it is not a regular file; remove it."
            )
        written = os.write(fd, line)
        if written != len(line):
            raise TranscriptWriteError(
                f"cannot append to {path}: only {written} of {len(line)} bytes were written; "
                "check free space."
            )
        os.fsync(fd)
    except OSError as exc:
        raise TranscriptWriteError(
            f"cannot append to {path}: {_reason(exc)}; check free space and the file system."
        ) from exc
    finally:
        os.close(fd)
    if created:
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            raise TranscriptWriteError(
                f"created {path} but could not make its directory durable: {_reason(exc)}."
            ) from exc


def child_path(directory: Path, name: str) -> Path:
    """``directory / name``, refused with :class:`InvalidValueError` unless it stays inside.

    Both sides are resolved, so ``..``, absolute names and symlinks pointing out of the directory
    are caught (the path-traversal guard). The unresolved path is returned; open it without
    following symlinks.
    """
    try:
        base = directory.resolve()
        target = (base / name).resolve()
    except (OSError, ValueError) as exc:
        raise InvalidValueError(
            "file_name", f"file name {shown(name)} cannot be used inside {directory}: {exc}."
        ) from exc
    if target == base or base not in target.parents:
        raise InvalidValueError(
            "file_name",
            f"file name {shown(name)} would leave {directory}; use a plain name without '..' or "
            "'/'.",
        )
    return directory / name
