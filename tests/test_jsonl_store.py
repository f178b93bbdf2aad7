"""The degraded JSONL backend: routing through sessions.json, append-only fsynced transcripts."""

from __future__ import annotations

import json
import logging
import os
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core.domain.errors import (
    DuplicateSessionIdError,
    InvalidValueError,
    StoreError,
    TranscriptReadError,
    TranscriptWriteError,
)
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.store.backend import CounterDelta, SessionRow, StoreBackend
from hermes_core.store.capabilities import PROTOCOLS, protocol_methods
from hermes_core.store.jsonl import JsonlBackend
from hermes_core.store.mirror import mirror_chunks, read_mirror

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
KEY = "agent:main:telegram:dm:42"
OTHER = "agent:main:discord:dm:7"
SID = "20260301_120000_aaaaaaaa"
SID2 = "20260301_130000_bbbbbbbb"
TOKEN = "0" * 32


def _model(entry: dict[str, Any]) -> SessionEntry:
    return SessionEntry.from_dict(entry)


def _entry(key: str = KEY, session_id: str = SID, **changes: Any) -> dict[str, Any]:
    platform = key.split(":")[2]
    origin = SessionSource(platform=platform, chat_id="42", thread_id="t1", profile="coder")
    fields: dict[str, Any] = {
        "session_key": key, "session_id": session_id, "created_at": T0,
        "updated_at": T0 + timedelta(minutes=5), "origin": origin, "platform": platform,
        "display_name": "Chat", "chat_type": "dm",
    }  # fmt: skip
    fields.update(changes)
    return SessionEntry(**fields).to_dict()


def _row(session_id: str = SID, key: str = KEY, **changes: Any) -> SessionRow:
    values: dict[str, Any] = {"id": session_id, "session_key": key, "source": "telegram"}
    values.update(started_at=T0.timestamp(), **changes)
    return SessionRow(**values)


@pytest.fixture
def sessions_dir(tmp_path: Path) -> Path:
    path = tmp_path / "sessions"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def backend(sessions_dir: Path) -> JsonlBackend:
    return JsonlBackend(sessions_dir)


def _mirror(sessions_dir: Path) -> dict[str, dict[str, Any]]:
    return {k: e.to_dict() for k, e in read_mirror(sessions_dir / "sessions.json").items()}


def _mirror_bytes(sessions_dir: Path) -> bytes:
    return (sessions_dir / "sessions.json").read_bytes()


def test_implements_the_required_protocol_and_no_capability(backend: JsonlBackend) -> None:
    typed: StoreBackend = backend
    assert typed.health() == {}
    assert all(callable(getattr(backend, name, None)) for name in protocol_methods(StoreBackend))
    optional = {name for protocol in PROTOCOLS.values() for name in protocol_methods(protocol)}
    assert [name for name in optional - set(protocol_methods(StoreBackend))
            if hasattr(backend, name)] == []  # fmt: skip


# -- routing ---------------------------------------------------------------------------------------


def test_put_route_rewrites_mirror_before_returning(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    backend.put_route(_entry())
    assert _mirror(sessions_dir) == {KEY: _entry()}
    assert stat.S_IMODE(os.stat(sessions_dir / "sessions.json").st_mode) == 0o600
    assert backend.get_route(KEY) == _entry()
    assert backend.get_route("agent:main:telegram:dm:unknown") is None
    assert backend.get_route_by_session_id(SID) == _entry()
    assert backend.get_route_by_session_id("nope") is None
    assert list(backend.iter_routes()) == [_entry()]


def test_routes_are_copies(backend: JsonlBackend) -> None:
    entry = _entry()
    backend.put_route(entry)
    entry["metadata"]["x"] = 1
    returned = backend.get_route(KEY)
    assert returned is not None
    assert returned["metadata"] == {}
    dict(returned)["metadata"]["y"] = 2
    assert backend.get_route(KEY) == _entry()


def test_replacing_session_id_updates_lookup_by_id(backend: JsonlBackend) -> None:
    backend.put_route(_entry())
    backend.put_route(_entry(session_id=SID2))
    assert backend.get_route_by_session_id(SID) is None
    assert backend.get_route_by_session_id(SID2) == _entry(session_id=SID2)


def test_touch_alone_does_not_rewrite(backend: JsonlBackend, sessions_dir: Path) -> None:
    backend.put_route(_entry())
    before = _mirror_bytes(sessions_dir)
    touched = _entry(updated_at=T0 + timedelta(hours=1))
    backend.put_route(touched, touch=True)
    assert backend.get_route(KEY) == touched
    assert _mirror_bytes(sessions_dir) == before
    assert backend.flush_touches() is False  # the last write is younger than 60 s
    assert _mirror_bytes(sessions_dir) == before


def test_touch_written_by_next_real_write(backend: JsonlBackend, sessions_dir: Path) -> None:
    backend.put_route(_entry())
    touched = _entry(updated_at=T0 + timedelta(hours=1))
    backend.put_route(touched, touch=True)
    backend.put_route(_entry(OTHER, SID2))
    assert _mirror(sessions_dir) == {KEY: touched, OTHER: _entry(OTHER, SID2)}
    assert backend.flush_touches() is False  # nothing pending any more


def test_touch_flushed_after_interval(sessions_dir: Path) -> None:
    backend = JsonlBackend(sessions_dir, touch_flush_interval=0.0)
    backend.put_route(_entry())
    touched = _entry(updated_at=T0 + timedelta(hours=1))
    backend.put_route(touched, touch=True)
    assert backend.flush_touches() is True
    assert _mirror(sessions_dir) == {KEY: touched}
    assert backend.flush_touches() is False


def test_touch_flushed_at_close(backend: JsonlBackend, sessions_dir: Path) -> None:
    backend.put_route(_entry())
    touched = _entry(updated_at=T0 + timedelta(hours=1))
    backend.put_route(touched, touch=True)
    backend.close()
    assert _mirror(sessions_dir) == {KEY: touched}


def test_close_without_changes_writes_nothing(backend: JsonlBackend, sessions_dir: Path) -> None:
    backend.close()
    assert not (sessions_dir / "sessions.json").exists()


def test_clear_turn_marker_is_compare_and_swap(backend: JsonlBackend, sessions_dir: Path) -> None:
    marked = _entry(active_turn_token=TOKEN, active_turn_started_at=T0)
    backend.put_route(marked)
    cleared = _entry()
    assert backend.clear_turn_marker(_model(cleared), "f" * 32) is False
    assert _mirror(sessions_dir) == {KEY: marked}
    assert backend.clear_turn_marker(_model(cleared), TOKEN) is True
    assert _mirror(sessions_dir) == {KEY: cleared}
    assert backend.clear_turn_marker(_model(cleared), TOKEN) is False
    assert backend.clear_turn_marker(_model(_entry(OTHER, SID2)), TOKEN) is False


def test_begin_turn_appends_message_then_writes_marker(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    backend.put_route(_entry())
    marked = _entry(active_turn_token=TOKEN, active_turn_started_at=T0)
    backend.begin_turn(
        _model(marked), 17, (SID, {"role": "user", "content": "hi", "timestamp": 1.0})
    )
    assert _mirror(sessions_dir) == {KEY: marked}
    assert backend.load_messages(SID) == [{"role": "user", "content": "hi", "timestamp": 1.0}]
    backend.begin_turn(
        _model(_entry(active_turn_token="1" * 32, active_turn_started_at=T0)), None, None
    )
    assert backend.load_messages(SID) == [{"role": "user", "content": "hi", "timestamp": 1.0}]


def test_begin_turn_with_failing_append_writes_no_marker(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    backend.put_route(_entry())
    marked = _entry(active_turn_token=TOKEN, active_turn_started_at=T0)
    with pytest.raises(InvalidValueError):
        backend.begin_turn(_model(marked), None, ("../evil", {"role": "user", "content": "x"}))
    assert _mirror(sessions_dir) == {KEY: _entry()}


def test_failed_rewrite_raises_and_undoes_the_change(
    backend: JsonlBackend, sessions_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.put_route(_entry())

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StoreError):
        backend.put_route(_entry(OTHER, SID2))
    with pytest.raises(StoreError):
        backend.put_route(_entry(session_id=SID2))
    assert backend.get_route(OTHER) is None
    assert backend.get_route(KEY) == _entry()
    assert backend.get_route_by_session_id(SID) == _entry()
    assert backend.count_sessions() == 1
    monkeypatch.undo()
    assert _mirror(sessions_dir) == {KEY: _entry()}


def test_failed_flush_keeps_touch_pending(
    backend: JsonlBackend, sessions_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.put_route(_entry())
    touched = _entry(updated_at=T0 + timedelta(hours=1))
    backend.put_route(touched, touch=True)

    def failing_replace(src: str | Path, dst: str | Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(StoreError):
        backend.close()
    monkeypatch.undo()
    backend.close()
    assert _mirror(sessions_dir) == {KEY: touched}


# -- sessions --------------------------------------------------------------------------------------


def test_no_sessions_without_entries(backend: JsonlBackend) -> None:
    assert backend.get_session(SID) is None
    assert backend.newest_session(KEY) is None
    assert backend.count_sessions() == 0


def test_sessions_are_synthesised_from_entries(backend: JsonlBackend) -> None:
    backend.put_route(_entry(input_tokens=3, total_tokens=5, prev_session_id=SID2))
    row = backend.get_session(SID)
    assert row is not None
    assert row == backend.newest_session(KEY)
    assert (row.id, row.session_key, row.source, row.chat_type) == (SID, KEY, "telegram", "dm")
    assert (row.chat_id, row.thread_id, row.profile_name) == ("42", "t1", "coder")
    assert row.started_at == T0.timestamp()
    assert row.last_activity_at == (T0 + timedelta(minutes=5)).timestamp()
    assert (row.ended_at, row.end_reason) == (None, None)
    assert (row.input_tokens, row.total_tokens) == (3, 5)
    assert row.parent_session_id == SID2
    assert row.reopenable
    assert json.loads(row.origin_json or "") == _entry()["origin"]


def test_create_session_remembers_row_and_writes_entry(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    backend.put_route(_entry())
    row = _row(SID2, parent_session_id=SID, user_id="u-9", profile_name="coder")
    backend.create_session(row, _entry(session_id=SID2), (SID, "session_reset"))
    assert _mirror(sessions_dir) == {KEY: _entry(session_id=SID2)}
    assert backend.get_session(SID) is None  # no longer the current session of a lane
    got = backend.get_session(SID2)
    assert got is not None
    assert (got.parent_session_id, got.user_id) == (SID, "u-9")
    assert got.last_activity_at == (T0 + timedelta(minutes=5)).timestamp()
    assert backend.count_sessions() == 1
    backend.create_session(_row(SID, OTHER), _entry(OTHER, SID), None)
    assert backend.count_sessions() == 2


def test_create_session_refuses_known_ids(backend: JsonlBackend, sessions_dir: Path) -> None:
    backend.put_route(_entry())
    with pytest.raises(DuplicateSessionIdError):
        backend.create_session(_row(SID, OTHER), _entry(OTHER, SID), None)
    (sessions_dir / f"{SID2}.jsonl.imported").write_bytes(b"")
    with pytest.raises(DuplicateSessionIdError):
        backend.create_session(_row(SID2, OTHER), _entry(OTHER, SID2), None)
    assert backend.get_route(OTHER) is None


def test_reopen_and_update_counters_write_the_entry(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    backend.reopen_session(SID, _entry())
    assert _mirror(sessions_dir) == {KEY: _entry()}
    counted = _entry(input_tokens=10, output_tokens=4, total_tokens=14, estimated_cost_usd=0.5)
    backend.update_counters(counted, SID, CounterDelta(input_tokens=10, output_tokens=4))
    assert _mirror(sessions_dir) == {KEY: counted}
    row = backend.get_session(SID)
    assert row is not None
    assert (row.input_tokens, row.output_tokens, row.total_tokens) == (10, 4, 14)
    assert row.estimated_cost_usd == 0.5


# -- transcripts -----------------------------------------------------------------------------------


def test_append_and_load(backend: JsonlBackend, sessions_dir: Path) -> None:
    assert backend.load_messages(SID) == []
    first = {"role": "user", "content": "héllo", "timestamp": 10.5, "custom": {"a": [1]}}
    assert backend.append_message(SID, first) == 1
    assert backend.append_message(SID, {"role": "assistant", "content": "hi"}) == 2
    path = sessions_dir / f"{SID}.jsonl"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().count(b"\n") == 2
    assert "héllo" in path.read_text(encoding="utf-8")
    loaded = backend.load_messages(SID)
    assert loaded[0] == first
    assert loaded[1]["role"] == "assistant"
    assert isinstance(loaded[1]["timestamp"], float)


def test_append_refuses_unsafe_session_ids(backend: JsonlBackend, sessions_dir: Path) -> None:
    for bad in ("../escape", "a/b", "..", ".hidden", ""):
        with pytest.raises(InvalidValueError):
            backend.append_message(bad, {"role": "user", "content": "x"})
        with pytest.raises(InvalidValueError):
            backend.load_messages(bad)
    assert list(sessions_dir.iterdir()) == []


def test_append_refuses_symlinked_transcript(
    backend: JsonlBackend, sessions_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    inside = sessions_dir / "inside.jsonl"
    inside.write_bytes(b"")
    (sessions_dir / f"{SID}.jsonl").symlink_to(outside)
    (sessions_dir / f"{SID2}.jsonl").symlink_to(inside)
    with pytest.raises(InvalidValueError):
        backend.append_message(SID, {"role": "user", "content": "x"})
    with pytest.raises(TranscriptWriteError):
        backend.append_message(SID2, {"role": "user", "content": "x"})
    with pytest.raises(TranscriptReadError):
        backend.load_messages(SID2)
    assert outside.read_bytes() == inside.read_bytes() == b""


def test_append_refuses_non_json_message(backend: JsonlBackend, sessions_dir: Path) -> None:
    with pytest.raises(InvalidValueError, match="not a JSON value"):
        backend.append_message(SID, {"role": "user", "content": object()})
    assert not (sessions_dir / f"{SID}.jsonl").exists()


def test_failed_append_raises(backend: JsonlBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend.append_message(SID, {"role": "user", "content": "one"})

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(TranscriptWriteError):
        backend.append_message(SID, {"role": "user", "content": "two"})
    monkeypatch.undo()
    assert backend.append_message(SID, {"role": "user", "content": "three"}) == 3


def test_torn_and_invalid_lines_are_skipped_with_one_warning(
    backend: JsonlBackend, sessions_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = sessions_dir / f"{SID}.jsonl"
    good = json.dumps({"role": "user", "content": "ok", "timestamp": 1.0})
    path.write_bytes(
        f'{good}\nnot json\n{{"role": "alien"}}\n[1]\n\n{good}\n{{"role": "assis'.encode()
    )
    with caplog.at_level(logging.WARNING, logger="hermes_core.store.jsonl"):
        assert backend.load_messages(SID) == [json.loads(good)] * 2
        assert backend.load_messages(SID) == [json.loads(good)] * 2
    assert len(caplog.records) == 1
    assert "ok" not in caplog.records[0].getMessage()  # no message text in logs


def test_append_after_torn_line_keeps_new_message_intact(
    sessions_dir: Path,
) -> None:
    path = sessions_dir / f"{SID}.jsonl"
    good = json.dumps({"role": "user", "content": "ok", "timestamp": 1.0})
    path.write_bytes(f'{good}\n{{"role": "assis'.encode())
    backend = JsonlBackend(sessions_dir)
    assert backend.append_message(SID, {"role": "assistant", "content": "new"}) == 3
    assert [m["content"] for m in backend.load_messages(SID)] == ["ok", "new"]
    assert backend.append_message(SID, {"role": "user", "content": "more"}) == 4


def test_unreadable_transcript_raises(backend: JsonlBackend, sessions_dir: Path) -> None:
    (sessions_dir / f"{SID}.jsonl").mkdir()
    with pytest.raises(TranscriptReadError):
        backend.load_messages(SID)


def test_imported_transcript_is_read_and_continued(
    backend: JsonlBackend, sessions_dir: Path
) -> None:
    """After a replay renamed the file, degraded mode continues the same file (offsets stay
    valid) and still shows its earlier messages."""
    imported = sessions_dir / f"{SID}.jsonl.imported"
    imported.write_bytes(b'{"role":"user","content":"old","timestamp":1}\n')
    assert [m["content"] for m in backend.load_messages(SID)] == ["old"]
    assert backend.append_message(SID, {"role": "assistant", "content": "new"}) == 2
    assert not imported.exists()
    assert [m["content"] for m in backend.load_messages(SID)] == ["old", "new"]


# -- restart ---------------------------------------------------------------------------------------


def test_restart_sees_routing_and_transcripts(sessions_dir: Path) -> None:
    first = JsonlBackend(sessions_dir)
    first.put_route(_entry())
    first.append_message(SID, {"role": "user", "content": "one", "timestamp": 1.0})
    touched = _entry(updated_at=T0 + timedelta(hours=2))
    first.put_route(touched, touch=True)
    first.close()
    second = JsonlBackend(sessions_dir)
    assert second.get_route(KEY) == touched
    assert second.count_sessions() == 1
    assert second.load_messages(SID) == [{"role": "user", "content": "one", "timestamp": 1.0}]
    assert second.append_message(SID, {"role": "assistant", "content": "two"}) == 2


def test_unregistered_platform_entries_survive_rewrites(sessions_dir: Path) -> None:
    ghost = _entry("agent:main:irc:dm:1", SID2, origin=None, platform=None)
    ghost["origin"] = {"platform": "irc", "chat_id": "1"}
    (sessions_dir / "sessions.json").write_bytes(
        b"".join(mirror_chunks({"agent:main:irc:dm:1": ghost}))
    )
    backend = JsonlBackend(sessions_dir)
    assert backend.get_route("agent:main:irc:dm:1") is None
    assert backend.count_sessions() == 0
    backend.put_route(_entry())
    document = json.loads((sessions_dir / "sessions.json").read_bytes())
    assert document["agent:main:irc:dm:1"] == ghost


def test_unusable_mirror_is_set_aside_not_overwritten(sessions_dir: Path) -> None:
    torn = b"".join(mirror_chunks({KEY: _entry()}))[:50]
    (sessions_dir / "sessions.json").write_bytes(torn)
    backend = JsonlBackend(sessions_dir)
    assert backend.count_sessions() == 0
    kept = [p for p in sessions_dir.iterdir() if p.name.startswith("sessions.json.unreadable-")]
    assert len(kept) == 1
    assert kept[0].read_bytes() == torn
    backend.put_route(_entry())
    assert _mirror(sessions_dir) == {KEY: _entry()}
    assert kept[0].read_bytes() == torn
