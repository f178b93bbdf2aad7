"""Secure file primitives: final modes, symlink refusal, atomic and durable writes, traversal."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_core.domain.errors import InvalidValueError, StoreError, TranscriptWriteError
from hermes_core.state.files import (
    append_line_durably,
    atomic_write,
    child_path,
    create_private_file,
    ensure_private_dir,
    fsync_dir,
    read_file_nofollow,
)


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    """Modes must come from the code, not from a restrictive umask."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def _failing_fsync(fd: int) -> None:
    raise OSError(5, "Input/output error")


# -- ensure_private_dir ----------------------------------------------------------------------------


def test_ensure_private_dir_creates_parents_0700(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert ensure_private_dir(target) == target
    for path in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert path.is_dir()
        assert _mode(path) == 0o700


def test_ensure_private_dir_existing_private_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "state"
    target.mkdir(mode=0o700)
    ensure_private_dir(target)
    assert caplog.records == []


def test_ensure_private_dir_warns_once_and_never_narrows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "wide"
    target.mkdir(mode=0o755)
    with caplog.at_level(logging.WARNING, logger="hermes_core.state.files"):
        ensure_private_dir(target)
    assert len(caplog.records) == 1
    assert str(target) in caplog.records[0].getMessage()
    assert _mode(target) == 0o755


def test_ensure_private_dir_accepts_symlink_to_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "home"
    link.symlink_to(real)
    assert ensure_private_dir(link) == link


@pytest.mark.parametrize("kind", ["file", "dangling-symlink"])
def test_ensure_private_dir_refuses_non_directory(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "thing"
    if kind == "file":
        target.write_bytes(b"x")
    else:
        target.symlink_to(tmp_path / "missing")
    with pytest.raises(StoreError, match="thing"):
        ensure_private_dir(target)


# -- atomic_write ----------------------------------------------------------------------------------


def test_atomic_write_creates_0600_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b"one")
    assert target.read_bytes() == b"one"
    assert _mode(target) == 0o600
    atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert _leftovers(tmp_path) == []


def test_atomic_write_keeps_old_file_when_fsync_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b"old")
    monkeypatch.setattr(os, "fsync", _failing_fsync)
    with pytest.raises(StoreError, match="previous version is kept") as info:
        atomic_write(target, b"new")
    assert isinstance(info.value.__cause__, OSError)
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_atomic_write_keeps_old_file_when_replace_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, b"old")

    def failing_replace(src: str | Path, dst: str | Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(StoreError):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_atomic_write_fsyncs_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic_write(tmp_path / "state.json", b"data")
    assert synced == [False, True]


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_atomic_write_refuses_special_targets(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "state.json"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    if kind == "symlink":
        target.symlink_to(victim)
    elif kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    with pytest.raises(StoreError, match="symlink or not a regular file"):
        atomic_write(target, b"evil")
    assert victim.read_bytes() == b"keep"
    assert _leftovers(tmp_path) == []


def test_atomic_write_missing_directory_is_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="writable"):
        atomic_write(tmp_path / "missing" / "state.json", b"x")


# -- create_private_file ---------------------------------------------------------------------------


def test_create_private_file_is_exclusive(tmp_path: Path) -> None:
    target = tmp_path / ".instance_id"
    assert create_private_file(target, b"first") is True
    assert _mode(target) == 0o600
    assert create_private_file(target, b"second") is False
    assert target.read_bytes() == b"first"


def test_create_private_file_refuses_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "pii_hmac.key"
    target.symlink_to(victim)
    with pytest.raises(StoreError):
        create_private_file(target, b"key")
    assert victim.read_bytes() == b"keep"


def test_create_private_file_removes_partial_file_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "pii_hmac.key"
    monkeypatch.setattr(os, "fsync", _failing_fsync)
    with pytest.raises(StoreError):
        create_private_file(target, b"key")
    assert not target.exists()


# -- append_line_durably ---------------------------------------------------------------------------


def test_append_line_durably_creates_0600_and_appends(tmp_path: Path) -> None:
    target = tmp_path / "s.jsonl"
    append_line_durably(target, b"one\n")
    append_line_durably(target, b"two\n")
    assert target.read_bytes() == b"one\ntwo\n"
    assert _mode(target) == 0o600


def test_append_line_durably_fsyncs_each_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "s.jsonl"
    append_line_durably(target, b"one\n")
    monkeypatch.setattr(os, "fsync", _failing_fsync)
    with pytest.raises(TranscriptWriteError):
        append_line_durably(target, b"two\n")


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_append_line_durably_refuses_special_files(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "s.jsonl"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    if kind == "symlink":
        target.symlink_to(victim)
    else:
        os.mkfifo(target)
    with pytest.raises(TranscriptWriteError):
        append_line_durably(target, b"evil\n")
    assert victim.read_bytes() == b"keep"


# -- reading and paths -----------------------------------------------------------------------------


def test_read_file_nofollow(tmp_path: Path) -> None:
    target = tmp_path / "file"
    assert read_file_nofollow(target) is None
    target.write_bytes(b"data")
    assert read_file_nofollow(target) == b"data"
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError, match="symbolic links"):
        read_file_nofollow(link)


def test_fsync_dir_on_a_directory(tmp_path: Path) -> None:
    fsync_dir(tmp_path)


def test_child_path_accepts_plain_names(tmp_path: Path) -> None:
    assert child_path(tmp_path, "20260101_000000_abcdef01.jsonl") == (
        tmp_path / "20260101_000000_abcdef01.jsonl"
    )


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "..", ".", "", "a/../../b", "x\0y"])
def test_child_path_refuses_traversal(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidValueError):
        child_path(tmp_path / "sessions", name)


def test_child_path_refuses_symlink_out_of_directory(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "evil.jsonl").symlink_to(tmp_path / "outside.jsonl")
    with pytest.raises(InvalidValueError):
        child_path(sessions, "evil.jsonl")
