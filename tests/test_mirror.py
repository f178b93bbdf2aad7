"""The sessions.json mirror: exact rendering, ordered atomic writes, tolerant reading."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core.domain.errors import StoreError
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.store.mirror import (
    MIRROR_README,
    MirrorWriter,
    load_mirror,
    mirror_chunks,
    read_mirror,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
LOGGER = "hermes_core.store.mirror"


def _entry(key: str, session_id: str, *, name: str | None = None) -> dict[str, Any]:
    origin = SessionSource(platform="telegram", chat_id="42", chat_name=name)
    return SessionEntry(
        session_key=key, session_id=session_id, created_at=T0, updated_at=T0 + timedelta(1),
        origin=origin, platform="telegram", display_name=name,
    ).to_dict()  # fmt: skip


KEY_A = "agent:main:telegram:dm:42"
KEY_B = "agent:main:telegram:dm:7"
ENTRIES = {
    KEY_B: _entry(KEY_B, "20260301_120000_bbbbbbbb"),
    KEY_A: _entry(KEY_A, "s-a", name="Zoë"),
}


def render_mirror(entries: dict[str, Any]) -> bytes:
    """The whole file content of ``entries``."""
    return b"".join(mirror_chunks(entries))


def _write(path: Path, text: str | bytes) -> None:
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)


# -- rendering -------------------------------------------------------------------------------------


def test_readme_is_exact() -> None:
    assert MIRROR_README == (
        "Mirror of the hermes-sessions routing index, kept for inspection and recovery only. The "
        "canonical index lives in the SQL store (storage.url); edits to this file are not read "
        "back while that store is available. Set gateway.write_sessions_json: false to stop "
        "writing it."
    )


def test_render_format() -> None:
    data = render_mirror(ENTRIES)
    assert not data.startswith(b"\xef\xbb\xbf")
    assert data.endswith(b"}\n")
    text = data.decode("utf-8")
    assert "Zoë" in text  # non-ASCII kept, not escaped
    document = json.loads(text)
    assert list(document) == ["_README", KEY_A, KEY_B]
    assert document["_README"] == MIRROR_README
    assert document[KEY_A] == ENTRIES[KEY_A]
    assert text.splitlines()[1] == f'  "_README": {json.dumps(MIRROR_README)},'
    assert text == json.dumps(document, ensure_ascii=False, indent=2) + "\n"


def test_render_empty_index() -> None:
    assert render_mirror({}) == (json.dumps({"_README": MIRROR_README}, indent=2) + "\n").encode(
        "utf-8"
    )


def test_render_refuses_non_json_values() -> None:
    with pytest.raises(StoreError):
        render_mirror({KEY_A: {"metadata": {"x": float("nan")}}})
    with pytest.raises(StoreError):
        render_mirror({KEY_A: {"metadata": {"x": object()}}})


# -- writing ---------------------------------------------------------------------------------------


def test_writer_writes_atomically_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    assert writer.revision is None
    assert writer.write(ENTRIES, 1) is True
    assert path.read_bytes() == render_mirror(ENTRIES)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert writer.revision == 1


def test_older_revision_never_replaces_newer(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    assert writer.write(ENTRIES, 5) is True
    assert writer.write({}, 4) is False
    assert read_mirror(path).keys() == ENTRIES.keys()
    assert writer.write({}, 5) is True  # the same revision may be written again
    assert read_mirror(path) == {}


def test_concurrent_writers_end_with_newest_revision(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    snapshots = {rev: {KEY_A: _entry(KEY_A, f"s-{rev}")} for rev in range(1, 41)}
    threads = [
        threading.Thread(target=writer.write, args=(snap, rev)) for rev, snap in snapshots.items()
    ]
    for thread in reversed(threads):
        thread.start()
    for thread in threads:
        thread.join()
    assert writer.revision == 40
    assert read_mirror(path)[KEY_A].session_id == "s-40"


def test_slow_old_writer_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that rendered revision 1 but reaches the lock after revision 2 writes nothing."""
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    rendered = threading.Event()
    proceed = threading.Event()
    real_chunks = mirror_chunks

    def slow_chunks(entries: Any, max_entries: int | None = None) -> Iterator[bytes]:
        yield from real_chunks(entries, max_entries)
        if not entries:
            rendered.set()
            proceed.wait(5)

    monkeypatch.setattr("hermes_core.store.mirror.mirror_chunks", slow_chunks)
    results: list[bool] = []
    old = threading.Thread(target=lambda: results.append(writer.write({}, 1)))
    old.start()
    assert rendered.wait(5)
    assert writer.write(ENTRIES, 2) is True
    proceed.set()
    old.join()
    assert results == [False]
    assert read_mirror(path).keys() == ENTRIES.keys()


def test_failed_write_keeps_old_file_and_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    writer.write(ENTRIES, 1)
    before = path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StoreError):
        writer.write({}, 2)
    assert path.read_bytes() == before
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []
    assert writer.revision == 1
    monkeypatch.undo()
    assert writer.write({}, 2) is True  # a failed revision can be written again later


def test_writer_refuses_symlinked_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "sessions.json"
    path.symlink_to(victim)
    with pytest.raises(StoreError):
        MirrorWriter(path).write(ENTRIES, 1)
    assert victim.read_bytes() == b"keep"


# -- reading ---------------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    MirrorWriter(path).write(ENTRIES, 1)
    loaded = read_mirror(path)
    assert {key: entry.to_dict() for key, entry in loaded.items()} == ENTRIES


def test_missing_file_is_silently_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_mirror(tmp_path / "sessions.json") == {}
    assert load_mirror(tmp_path / "sessions.json").problem is None
    assert caplog.records == []


def test_bom_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    _write(path, b"\xef\xbb\xbf" + render_mirror(ENTRIES))
    assert read_mirror(path).keys() == ENTRIES.keys()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(render_mirror(ENTRIES)[: len(render_mirror(ENTRIES)) // 2], id="torn"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b'"text"', id="string"),
        pytest.param(b"\xff\xfe{}", id="not-utf8"),
    ],
)
def test_unusable_file_warns_once_and_is_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "sessions.json"
    _write(path, content)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        contents = load_mirror(path)
    assert contents.entries == {}
    assert contents.problem is not None
    assert len(caplog.records) == 1
    assert str(path) in caplog.records[0].getMessage()
    assert path.read_bytes() == content


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of their mode")
def test_unreadable_file_warns_and_is_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sessions.json"
    _write(path, render_mirror(ENTRIES))
    path.chmod(0)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert read_mirror(path) == {}
        assert len(caplog.records) == 1
        assert str(path) in caplog.records[0].getMessage()
    finally:
        path.chmod(0o600)
    assert path.read_bytes() == render_mirror(ENTRIES)


def test_read_error_warns_and_is_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same as the chmod test, for runs as root: a permission error while reading."""
    path = tmp_path / "sessions.json"
    _write(path, render_mirror(ENTRIES))

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        contents = load_mirror(path)
    monkeypatch.undo()
    assert contents.entries == {}
    assert contents.problem is not None
    assert "Permission denied" in contents.problem
    assert len(caplog.records) == 1
    assert str(path) in caplog.records[0].getMessage()
    assert path.read_bytes() == render_mirror(ENTRIES)


def test_directory_in_place_of_file_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sessions.json"
    path.mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_mirror(path) == {}
    assert len(caplog.records) == 1


def test_invalid_entries_skipped_with_warning_naming_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sessions.json"
    bad_time = {**_entry("agent:main:bad-time", "s-1"), "created_at": "yesterday"}
    bad_id = {**_entry("agent:main:bad-id", "s-2"), "session_id": "../../etc"}
    moved = _entry("agent:main:real", "s-3")
    document = {
        "_README": "ignored",
        "_comment": {"not": "an entry"},
        KEY_A: ENTRIES[KEY_A],
        "agent:main:bad-time": bad_time,
        "agent:main:bad-id": bad_id,
        "agent:main:not-object": [1, 2],
        "agent:main:moved": moved,
    }
    _write(path, json.dumps(document))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = read_mirror(path)
    assert list(loaded) == [KEY_A]
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 4
    for key in (
        "agent:main:bad-time",
        "agent:main:bad-id",
        "agent:main:not-object",
        "agent:main:moved",
    ):
        assert sum(repr(key) in message for message in messages) == 1
    assert not any("_comment" in message for message in messages)


def test_unregistered_platform_kept_aside_with_one_warning_per_platform(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sessions.json"
    ghosts = {}
    for number in range(3):
        ghost = _entry(f"agent:main:irc:dm:{number}", f"s-{number}")
        ghost["origin"] = {**ghost["origin"], "platform": "irc"}
        ghosts[f"agent:main:irc:dm:{number}"] = ghost
    _write(path, render_mirror({**ghosts, KEY_A: ENTRIES[KEY_A]}))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        contents = load_mirror(path)
    assert list(contents.entries) == [KEY_A]
    assert contents.unregistered == ghosts
    assert len(caplog.records) == 1
    assert "'irc'" in caplog.records[0].getMessage()


def test_read_does_not_modify_file(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    content = render_mirror(ENTRIES).replace(b'"s-a"', b'"../x"')
    _write(path, content)
    before = os.stat(path)
    read_mirror(path)
    after = os.stat(path)
    assert path.read_bytes() == content
    assert (before.st_mtime_ns, before.st_ino) == (after.st_mtime_ns, after.st_ino)
