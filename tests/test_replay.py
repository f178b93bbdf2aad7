"""Backlog replay: exactly-once import of JSONL transcripts and the routing merge."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.store.backend import BacklogTarget, EntryDict, Message, SessionRow
from hermes_core.store.jsonl import JsonlBackend
from hermes_core.store.mirror import mirror_chunks
from hermes_core.store.replay import (
    ParsedLines,
    ReplayReport,
    encode_message_line,
    parse_lines,
    replay_backlog,
    session_row_from_entry,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
KEY = "agent:main:telegram:dm:42"
OTHER = "agent:main:telegram:dm:7"
SID = "20260301_120000_aaaaaaaa"
SID2 = "20260301_130000_bbbbbbbb"


class FakeTarget:
    """An in-memory SQL store: routing rows, session rows, messages and state_meta."""

    def __init__(self) -> None:
        self.meta: dict[str, str] = {}
        self.routes: dict[str, dict[str, Any]] = {}
        self.sessions: dict[str, SessionRow] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.imports = 0

    def get_meta(self, name: str) -> str | None:
        return self.meta.get(name)

    def get_route(self, session_key: str) -> EntryDict | None:
        return self.routes.get(session_key)

    def put_route(self, entry: EntryDict, *, touch: bool = False) -> None:
        self.routes[entry["session_key"]] = dict(entry)

    def get_session(self, session_id: str) -> SessionRow | None:
        return self.sessions.get(session_id)

    def import_backlog(
        self,
        session_id: str,
        messages: Sequence[Message],
        offset: tuple[str, str],
        create_row: SessionRow | None,
    ) -> None:
        if create_row is not None:
            assert create_row.id == session_id
            assert session_id not in self.sessions
            self.sessions[session_id] = create_row
        assert session_id in self.sessions or not messages  # the foreign key of messages
        self.messages.setdefault(session_id, []).extend(dict(m) for m in messages)
        self.meta[offset[0]] = offset[1]
        self.imports += 1


class Crash(Exception):
    """Stands for the process dying at this point."""


def _entry(
    key: str = KEY,
    session_id: str = SID,
    *,
    created: datetime = T0,
    updated: datetime = T0,
    **changes: Any,
) -> SessionEntry:
    origin = SessionSource(platform="telegram", chat_id="42", user_id="u1", profile="coder")
    values: dict[str, Any] = {
        "session_key": key, "session_id": session_id, "created_at": created,
        "updated_at": updated, "origin": origin, "platform": "telegram", "display_name": "Chat",
    }  # fmt: skip
    values.update(changes)
    return SessionEntry(**values)


def _message(number: int) -> dict[str, Any]:
    return {"role": "user", "content": f"message {number}", "timestamp": float(number)}


def _lines(*numbers: int) -> bytes:
    return b"".join(encode_message_line(_message(number)) for number in numbers)


@pytest.fixture
def sessions_dir(tmp_path: Path) -> Path:
    path = tmp_path / "sessions"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def target() -> FakeTarget:
    return FakeTarget()


def _write_mirror(sessions_dir: Path, *entries: SessionEntry) -> None:
    document = {entry.session_key: entry.to_dict() for entry in entries}
    (sessions_dir / "sessions.json").write_bytes(b"".join(mirror_chunks(document)))


def _run(sessions_dir: Path, target: FakeTarget) -> ReplayReport:
    typed: BacklogTarget = target
    return replay_backlog(sessions_dir, typed)


# -- line format -----------------------------------------------------------------------------------


def test_encode_message_line() -> None:
    line = encode_message_line({"role": "user", "content": "é\nx", "timestamp": 2.5})
    assert line == '{"role":"user","content":"é\\nx","timestamp":2.5}\n'.encode()
    stamped = json.loads(encode_message_line({"role": "user", "timestamp": None}))
    assert isinstance(stamped["timestamp"], float)


def test_parse_lines_skips_invalid_and_torn() -> None:
    data = _lines(1) + b"garbage\n" + b'{"role":"alien"}\n' + b"\n" + _lines(2) + b'{"role":"us'
    parsed = parse_lines(data)
    assert parsed.messages == [_message(1), _message(2)]
    assert parsed.invalid == 2
    assert parsed.torn is True
    assert parsed.consumed == len(data) - len(b'{"role":"us')
    assert parse_lines(b"") == ParsedLines([], 0, 0, False)


def test_session_row_from_entry() -> None:
    entry = _entry(updated=T0 + timedelta(hours=1), input_tokens=4, total_tokens=6)
    row = session_row_from_entry(entry, parent_session_id=SID2)
    assert (row.id, row.session_key, row.source, row.chat_type) == (SID, KEY, "telegram", "dm")
    assert (row.chat_id, row.user_id, row.profile_name, row.display_name) == (
        "42", "u1", "coder", "Chat"
    )  # fmt: skip
    assert row.started_at == T0.timestamp()
    assert row.last_activity_at == (T0 + timedelta(hours=1)).timestamp()
    assert (row.input_tokens, row.total_tokens, row.parent_session_id) == (4, 6, SID2)
    assert row.ended_at is None
    assert entry.origin is not None
    assert json.loads(row.origin_json or "") == entry.origin.to_dict()
    bare = session_row_from_entry(_entry(origin=None, platform=None))
    assert (bare.source, bare.chat_id, bare.origin_json) == ("unknown", None, None)


# -- transcripts -----------------------------------------------------------------------------------


def test_replays_file_creates_row_and_renames(sessions_dir: Path, target: FakeTarget) -> None:
    entry = _entry()
    _write_mirror(sessions_dir, entry)
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1, 2))
    report = _run(sessions_dir, target)
    assert report == ReplayReport(files_replayed=1, messages_imported=2, routes_inserted=1)
    assert target.messages[SID] == [_message(1), _message(2)]
    assert target.sessions[SID] == session_row_from_entry(entry)
    assert target.meta[f"jsonl_import:{SID}"] == str(len(_lines(1, 2)))
    assert target.routes[KEY] == entry.to_dict()
    assert not (sessions_dir / f"{SID}.jsonl").exists()
    assert (sessions_dir / f"{SID}.jsonl.imported").read_bytes() == _lines(1, 2)
    assert _run(sessions_dir, target) == ReplayReport()  # nothing left to do


def test_crash_between_commit_and_rename_imports_nothing_twice(
    sessions_dir: Path, target: FakeTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_mirror(sessions_dir, _entry())
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1, 2, 3))

    def crash(src: Any, dst: Any) -> None:
        raise Crash

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(Crash):
        _run(sessions_dir, target)
    assert len(target.messages[SID]) == 3
    assert (sessions_dir / f"{SID}.jsonl").exists()
    monkeypatch.undo()
    report = _run(sessions_dir, target)
    assert (report.files_replayed, report.messages_imported) == (1, 0)
    assert target.messages[SID] == [_message(1), _message(2), _message(3)]
    assert (sessions_dir / f"{SID}.jsonl.imported").exists()


def test_failed_rename_is_reported_and_retried(
    sessions_dir: Path, target: FakeTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_mirror(sessions_dir, _entry())
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))

    def failing(src: Any, dst: Any) -> None:
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", failing)
    report = _run(sessions_dir, target)
    assert report.files_replayed == 0
    assert report.messages_imported == 1
    assert [name for name, _ in report.skipped] == [f"{SID}.jsonl"]
    monkeypatch.undo()
    again = _run(sessions_dir, target)
    assert (again.files_replayed, again.messages_imported) == (1, 0)
    assert target.messages[SID] == [_message(1)]


def test_resumes_after_stored_offset(sessions_dir: Path, target: FakeTarget) -> None:
    target.sessions[SID] = session_row_from_entry(_entry())
    target.meta[f"jsonl_import:{SID}"] = str(len(_lines(1, 2)))
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1, 2, 3, 4))
    report = _run(sessions_dir, target)
    assert report.messages_imported == 2
    assert target.messages[SID] == [_message(3), _message(4)]
    assert target.meta[f"jsonl_import:{SID}"] == str(len(_lines(1, 2, 3, 4)))


def test_torn_last_line_is_left_for_later(sessions_dir: Path, target: FakeTarget) -> None:
    _write_mirror(sessions_dir, _entry())
    path = sessions_dir / f"{SID}.jsonl"
    full = encode_message_line(_message(2))
    path.write_bytes(_lines(1) + full[:10])
    report = _run(sessions_dir, target)
    assert report.messages_imported == 1
    assert report.files_replayed == 0
    assert report.skipped[0][0] == f"{SID}.jsonl"
    assert "incomplete" in report.skipped[0][1]
    assert target.meta[f"jsonl_import:{SID}"] == str(len(_lines(1)))
    assert path.exists()
    with path.open("ab") as handle:  # the writer finishes its line
        handle.write(full[10:])
    report = _run(sessions_dir, target)
    assert (report.files_replayed, report.messages_imported) == (1, 1)
    assert target.messages[SID] == [_message(1), _message(2)]


def test_existing_row_needs_no_mirror_entry(sessions_dir: Path, target: FakeTarget) -> None:
    row = session_row_from_entry(_entry(), parent_session_id=None)
    target.sessions[SID] = row
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    report = _run(sessions_dir, target)
    assert report.messages_imported == 1
    assert target.sessions[SID] is row


def test_without_row_or_mirror_entry_file_is_left_in_place(
    sessions_dir: Path, target: FakeTarget, caplog: pytest.LogCaptureFixture
) -> None:
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    with caplog.at_level(logging.WARNING, logger="hermes_core.store.replay"):
        report = _run(sessions_dir, target)
    assert report.messages_imported == 0
    assert report.skipped == ((f"{SID}.jsonl", report.skipped[0][1]),)
    assert "no session row" in report.skipped[0][1]
    assert target.imports == 0
    assert target.meta == {}
    assert (sessions_dir / f"{SID}.jsonl").exists()
    assert len(caplog.records) == 1


def test_parent_session_kept_only_when_its_row_exists(
    sessions_dir: Path, target: FakeTarget
) -> None:
    first = _entry(KEY, SID, prev_session_id="20250101_000000_00000000")
    second = _entry(OTHER, SID2, prev_session_id=SID)
    _write_mirror(sessions_dir, first, second)
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    (sessions_dir / f"{SID2}.jsonl").write_bytes(_lines(2))
    _run(sessions_dir, target)
    assert target.sessions[SID].parent_session_id is None
    assert target.sessions[SID2].parent_session_id == SID


def test_invalid_lines_are_passed_over(sessions_dir: Path, target: FakeTarget) -> None:
    _write_mirror(sessions_dir, _entry())
    data = b"junk\n" + _lines(1) + b"[]\n"
    (sessions_dir / f"{SID}.jsonl").write_bytes(data)
    report = _run(sessions_dir, target)
    assert (report.messages_imported, report.invalid_lines, report.files_replayed) == (1, 2, 1)
    assert target.meta[f"jsonl_import:{SID}"] == str(len(data))


def test_only_invalid_lines_store_offset_without_row(
    sessions_dir: Path, target: FakeTarget
) -> None:
    (sessions_dir / f"{SID}.jsonl").write_bytes(b"junk\n")
    report = _run(sessions_dir, target)
    assert (report.files_replayed, report.invalid_lines) == (1, 1)
    assert target.sessions == {}
    assert target.meta == {f"jsonl_import:{SID}": "5"}


def test_files_that_are_not_transcripts_are_skipped(
    sessions_dir: Path, target: FakeTarget, tmp_path: Path
) -> None:
    (sessions_dir / "bad..name.jsonl").write_bytes(_lines(1))
    (sessions_dir / ".hidden.jsonl").write_bytes(_lines(1))
    (sessions_dir / f"{SID}.jsonl.imported").write_bytes(_lines(1))
    (sessions_dir / ".sessions.json.0123.tmp").write_bytes(b"{}")
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(_lines(1))
    (sessions_dir / f"{SID2}.jsonl").symlink_to(outside)
    report = _run(sessions_dir, target)
    assert sorted(name for name, _ in report.skipped) == sorted(
        ["bad..name.jsonl", ".hidden.jsonl", f"{SID2}.jsonl"]
    )
    assert target.imports == 0
    assert (sessions_dir / f"{SID}.jsonl.imported").exists()


@pytest.mark.parametrize("stored", ["junk", "-1", "999999"])
def test_unusable_stored_offset_leaves_file(
    sessions_dir: Path, target: FakeTarget, stored: str
) -> None:
    _write_mirror(sessions_dir, _entry())
    target.meta[f"jsonl_import:{SID}"] = stored
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    report = _run(sessions_dir, target)
    assert [name for name, _ in report.skipped] == [f"{SID}.jsonl"]
    assert target.messages.get(SID, []) == []
    assert target.meta[f"jsonl_import:{SID}"] == stored  # the routed lane's row: offset kept
    assert (sessions_dir / f"{SID}.jsonl").exists()


def test_existing_imported_file_is_never_overwritten(
    sessions_dir: Path, target: FakeTarget
) -> None:
    _write_mirror(sessions_dir, _entry())
    (sessions_dir / f"{SID}.jsonl.imported").write_bytes(b"older\n")
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    report = _run(sessions_dir, target)
    assert report.messages_imported == 1
    assert "already exists" in report.skipped[0][1]
    assert (sessions_dir / f"{SID}.jsonl.imported").read_bytes() == b"older\n"
    assert _run(sessions_dir, target).messages_imported == 0


# -- routing ---------------------------------------------------------------------------------------


def test_routing_merge_rules(sessions_dir: Path, target: FakeTarget) -> None:
    late = T0 + timedelta(hours=1)
    keys = [f"agent:main:telegram:dm:{n}" for n in range(5)]
    mirror = [
        _entry(keys[0], "s-0"),  # missing in SQL: inserted
        _entry(keys[1], "s-1m", updated=late),  # newer activity than SQL: mirror wins
        _entry(keys[2], "s-2m"),  # older than SQL: SQL wins
        _entry(keys[3], "s-3m"),  # tie: SQL wins
        _entry(keys[4], "s-4m", created=late),  # newer session beats SQL's later activity
    ]
    sql = {
        keys[1]: _entry(keys[1], "s-1s"),
        keys[2]: _entry(keys[2], "s-2s", updated=late),
        keys[3]: _entry(keys[3], "s-3s"),
        keys[4]: _entry(keys[4], "s-4s", updated=late + timedelta(hours=5)),
    }
    for key, entry in sql.items():
        target.routes[key] = entry.to_dict()
        target.sessions[entry.session_id] = session_row_from_entry(entry)
    _write_mirror(sessions_dir, *mirror)
    (sessions_dir / "s-0.jsonl").write_bytes(_lines(1))  # a backlog: the mirror is merged
    report = _run(sessions_dir, target)
    assert (report.routes_inserted, report.routes_updated) == (1, 2)
    winners = {key: target.routes[key]["session_id"] for key in keys}
    assert winners == dict(zip(keys, ["s-0", "s-1m", "s-2s", "s-3s", "s-4m"], strict=True))


def test_routes_get_session_rows(sessions_dir: Path, target: FakeTarget) -> None:
    """A lane created while degraded with no transcript yet still gets its session row."""
    entry = _entry()
    other = _entry("agent:main:telegram:dm:other", "s-other")
    _write_mirror(sessions_dir, entry, other)
    (sessions_dir / "s-other.jsonl").write_bytes(_lines(1))
    _run(sessions_dir, target)
    assert target.sessions[SID] == session_row_from_entry(entry)
    assert target.messages[SID] == []
    assert target.meta[f"jsonl_import:{SID}"] == "0"


def test_without_a_backlog_the_mirror_is_never_read_back(
    sessions_dir: Path, target: FakeTarget
) -> None:
    """A hand-edited or old sessions.json neither revives pruned lanes nor overwrites routes."""
    stored = _entry()
    target.routes[KEY] = stored.to_dict()
    target.sessions[SID] = session_row_from_entry(stored)
    newer = _entry(session_id="s-edited", created=T0 + timedelta(days=9))
    pruned = _entry("agent:main:telegram:dm:pruned", "s-pruned")
    _write_mirror(sessions_dir, newer, pruned)
    report = _run(sessions_dir, target)
    assert (report.routes_inserted, report.routes_updated) == (0, 0)
    assert target.routes == {KEY: stored.to_dict()}
    assert "s-pruned" not in target.sessions


def test_unparsable_sql_times_keep_sql(sessions_dir: Path, target: FakeTarget) -> None:
    target.routes[KEY] = {"session_key": KEY, "session_id": "sql", "created_at": "bad"}
    target.sessions[SID] = session_row_from_entry(_entry())
    _write_mirror(sessions_dir, _entry(created=T0 + timedelta(days=9)))
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    assert _run(sessions_dir, target).routes_updated == 0
    assert target.routes[KEY]["session_id"] == "sql"


def test_unusable_mirror_replays_transcripts_with_rows(
    sessions_dir: Path, target: FakeTarget
) -> None:
    (sessions_dir / "sessions.json").write_bytes(b"{ torn")
    target.sessions[SID] = session_row_from_entry(_entry())
    (sessions_dir / f"{SID}.jsonl").write_bytes(_lines(1))
    report = _run(sessions_dir, target)
    assert (report.files_replayed, report.routes_inserted) == (1, 0)
    assert (sessions_dir / "sessions.json").read_bytes() == b"{ torn"


# -- with the degraded backend ---------------------------------------------------------------------


def test_degraded_twice_imports_each_line_once(sessions_dir: Path, target: FakeTarget) -> None:
    """Degraded, replayed, degraded again on the same session, replayed again."""
    entry = _entry().to_dict()
    backend = JsonlBackend(sessions_dir)
    backend.put_route(entry)
    backend.append_message(SID, _message(1))
    backend.append_message(SID, _message(2))
    backend.close()
    assert _run(sessions_dir, target).messages_imported == 2

    backend = JsonlBackend(sessions_dir)
    backend.append_message(SID, _message(3))
    backend.close()
    report = _run(sessions_dir, target)
    assert (report.files_replayed, report.messages_imported) == (1, 1)
    assert target.messages[SID] == [_message(1), _message(2), _message(3)]
    assert os.listdir(sessions_dir).count(f"{SID}.jsonl.imported") == 1


def test_report_counts_are_read_only(sessions_dir: Path, target: FakeTarget) -> None:
    report = _run(sessions_dir, target)
    with pytest.raises(AttributeError):
        report.files_replayed = 3  # type: ignore[misc]
    assert isinstance(report.skipped, tuple)
