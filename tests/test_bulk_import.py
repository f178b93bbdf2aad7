"""``hermes-sessions import-gateway DIR``: a gateway's sessions.json and JSONL transcripts
imported in bulk keep every lane's state and every message (SQLite and PostgreSQL), and a run
killed midway (SIGKILL of a real child process) is completed by running it again, with nothing
lost or doubled."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from support.database import run_sql
from support.populate import config_for

from conftest import builtins_only
from hermes_core.cli.common import open_operator
from hermes_core.cli.main import main
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import KeySchemaError
from hermes_core.domain.keys import build_key_from_flags
from hermes_core.domain.models import SessionEntry, SessionSource
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.store.base import KEY_SCHEMA_META
from hermes_core.store.bulk import ImportedLane, import_lanes
from hermes_core.store.keyschema import keys_in_both
from hermes_core.store.replay import encode_message_line, session_row_from_entry
from hermes_plugins.sql_store.dialects.sqlite_fts import INDEX_EVERY

LANES = 40
EPOCH = datetime(2026, 3, 1, tzinfo=timezone.utc)


def _transcript(lane: int) -> list[dict[str, Any]]:
    """Skewed lengths (lane 1 has 60 messages, most a few, some none), several kinds of message."""
    messages: list[dict[str, Any]] = []
    for n in range(120 // (lane + 1) if lane % 7 else 0):
        stamp = EPOCH.timestamp() + lane * 1000 + n
        if n % 5 == 3:
            call = {"id": f"c{n}", "function": {"name": "look"}}
            messages.append({"role": "assistant", "timestamp": stamp, "tool_calls": [call]})
        elif n % 5 == 4:
            messages.append({"role": "tool", "content": f"result {n}", "tool_call_id": f"c{n}",
                             "tool_name": "look", "timestamp": stamp})  # fmt: skip
        else:
            role = "user" if n % 2 == 0 else "assistant"
            text = f"lane {lane} message {n}: zebra café" if n == 0 else f"lane {lane} says {n}"
            messages.append({"role": role, "content": text, "timestamp": stamp,
                             "platform_message_id": f"p{n}", "mood": "calm"})  # fmt: skip
    return messages


def _entry(lane: int) -> SessionEntry:
    source = SessionSource(platform="telegram", chat_id=str(5000 + lane), user_id=str(lane),
                           user_name=f"user {lane}")  # fmt: skip
    return SessionEntry(
        session_key=build_key_from_flags(source),
        session_id=f"20260301_000000_{lane:08x}",
        created_at=EPOCH + timedelta(minutes=lane),
        updated_at=EPOCH + timedelta(hours=lane),
        origin=source, platform="telegram", chat_type="dm", display_name=f"user {lane}",
        input_tokens=10 * lane, output_tokens=lane, total_tokens=11 * lane,
        suspended=lane % 9 == 1, resume_pending=lane % 11 == 2,
    )  # fmt: skip


def gateway_directory(path: Path) -> dict[str, SessionEntry]:
    """A sessions directory as a gateway leaves it: the entries by key (also written), one
    transcript per lane that has messages, an invalid line and an orphan transcript."""
    path.mkdir()
    entries = {entry.session_key: entry for entry in map(_entry, range(LANES))}
    mirror = {key: entry.to_dict() for key, entry in entries.items()}
    (path / "sessions.json").write_text(json.dumps(mirror), encoding="utf-8")
    for lane, entry in enumerate(entries.values()):
        lines = b"".join(map(encode_message_line, _transcript(lane)))
        if lane == 3:
            lines += b"not json\n"
        if lines:
            (path / f"{entry.session_id}.jsonl").write_bytes(lines)
    (path / "20250101_000000_deadbeef.jsonl").write_bytes(b'{"role": "user", "content": "x"}\n')
    return entries


def _where(home: Path, settings: dict[str, Any]) -> list[str]:
    url = settings.get("storage", {}).get("url")
    return ["--state-dir", str(home), *(["--url", url] if url else [])]


def _import(capsys: pytest.CaptureFixture[str], where: list[str], source: Path) -> Any:
    assert main(["import-gateway", *where, str(source), "--batch", "7", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _stored(message: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in message.items() if name != "id"}


def assert_imported(home: Path, settings: dict[str, Any], entries: dict[str, SessionEntry]) -> None:
    """Every lane's entry and session, and every message, in order, once."""
    url = settings.get("storage", {}).get("url")
    with SessionStore.open(config_for(home, url), read_only=True) as store:
        assert len(store.list_sessions()) == LANES
        for lane, (key, entry) in enumerate(entries.items()):
            stored = store.lookup_by_session_key(key)
            assert stored is not None
            assert stored.to_dict() == entry.to_dict()
            row = store._backing.backend.get_session(entry.session_id)
            assert row is not None
            expected = _transcript(lane)
            assert row.message_count == len(expected)
            assert row.input_tokens == entry.input_tokens
            assert [_stored(m) for m in store.load_transcript(entry.session_id)] == expected
        assert len(store.search("zebra", limit=100)) == sum(1 for lane in range(LANES) if lane % 7)


def test_import_keeps_every_lane_and_message(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    entries = gateway_directory(tmp_path / "gateway")
    where = _where(tmp_path / "state", settings)
    report = _import(capsys, where, tmp_path / "gateway")
    total = sum(len(_transcript(lane)) for lane in range(LANES))
    assert report == {"lanes": LANES, "messages": total, "skipped": 0, "invalid_lines": 1,
                      "orphan_transcripts": 1, "left_out": []}  # fmt: skip
    assert_imported(tmp_path / "state", settings, entries)
    if not settings:  # SQLite's full-text index caught up with the import: no tail to scan
        with closing(sqlite3.connect(tmp_path / "state" / "state.db")) as raw:
            newest = raw.execute("SELECT max(id) FROM messages").fetchone()[0]
            mark = "SELECT value FROM state_meta WHERE key = 'fts_indexed_through'"
            assert 0 <= newest - int(raw.execute(mark).fetchone()[0]) < INDEX_EVERY < newest
    else:  # PostgreSQL's planner has statistics of what was written, autovacuum or not
        analyzed = run_sql(
            settings["storage"]["url"],
            "SELECT DISTINCT tablename FROM pg_stats WHERE schemaname = current_schema() "
            "AND tablename IN ('messages', 'sessions', 'gateway_routing')",
        )
        assert sorted(row[0] for row in analyzed) == ["gateway_routing", "messages", "sessions"]
    again = _import(capsys, where, tmp_path / "gateway")  # a second run changes nothing
    assert (again["lanes"], again["messages"], again["skipped"]) == (0, 0, LANES)
    assert_imported(tmp_path / "state", settings, entries)


KILLED_AFTER_TWO_BATCHES = """
import os, signal, sys
from hermes_core.cli.main import main
from hermes_plugins.sql_store.backend import SqlBackend

import_lanes = SqlBackend.import_lanes
calls = []

def import_then_die(self, lanes):
    counts = import_lanes(self, lanes)
    calls.append(counts)
    if len(calls) == 2:  # two batches are committed: die before the third
        os.kill(os.getpid(), signal.SIGKILL)
    return counts

SqlBackend.import_lanes = import_then_die
sys.exit(main(["import-gateway", *sys.argv[1:], "--batch", "7"]))
"""


def test_an_import_killed_midway_completes_when_run_again(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    entries = gateway_directory(tmp_path / "gateway")
    where = _where(tmp_path / "state", settings)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_TWO_BATCHES, *where, str(tmp_path / "gateway")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=builtins_only(), check=False,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL
    report = _import(capsys, where, tmp_path / "gateway")
    assert (report["lanes"], report["skipped"]) == (LANES - 14, 14)
    assert_imported(tmp_path / "state", settings, entries)


def test_import_names_a_directory_without_sessions_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code = main(["import-gateway", "--state-dir", str(tmp_path / "state"), str(tmp_path / "empty")])
    assert code == 2
    assert "sessions.json" in capsys.readouterr().err


def test_import_refuses_lanes_of_the_other_key_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_for(tmp_path / "state")
    plugins = create_plugin_manager(config, load_entrypoints=False)
    SessionStore.open(config, plugins=plugins).close()  # a new store records keys.schema: v2
    source = tmp_path / "gateway"
    source.mkdir()
    entry = _entry(1)
    assert entry.origin is not None
    v1, _ = keys_in_both(entry.origin, config, plugins)
    old = entry.model_copy(update={"session_key": v1})
    (source / "sessions.json").write_text(json.dumps({v1: old.to_dict()}), encoding="utf-8")
    where = ["--state-dir", str(tmp_path / "state")]
    assert main(["import-gateway", *where, str(source)]) == 2
    assert "keyed in key schema v1, but this store records v2" in capsys.readouterr().err
    with SessionStore.open(config, plugins=plugins, read_only=True) as store:
        assert store.list_sessions() == []


def _recorded_schema(home: Path, settings: dict[str, Any]) -> str | None:
    target = open_operator(config_for(home, settings.get("storage", {}).get("url")), write=False)
    try:
        return target.get_meta(KEY_SCHEMA_META)
    finally:
        target.close()


@pytest.mark.parametrize("schema", ["v1", "v2"])
def test_an_import_records_the_key_schema_of_its_lanes(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str], schema: str
) -> None:
    """Lanes keyed in v1 (the original gateway's) or v2 make an empty store record that
    schema, so its first open need not tell it from the routing rows."""
    source = tmp_path / "gateway"
    entries = gateway_directory(source)
    if schema == "v1":
        config = config_for(tmp_path / "state")
        plugins = create_plugin_manager(config, load_entrypoints=False)
        old = {}
        for entry in entries.values():
            assert entry.origin is not None
            key = keys_in_both(entry.origin, config, plugins)[0]
            old[key] = entry.model_copy(update={"session_key": key}).to_dict()
        (source / "sessions.json").write_text(json.dumps(old), encoding="utf-8")
    _import(capsys, _where(tmp_path / "state", settings), source)
    assert _recorded_schema(tmp_path / "state", settings) == schema
    url = settings.get("storage", {}).get("url")
    if schema == "v1":  # keys.schema is v2 by default: the open says what to do
        with pytest.raises(KeySchemaError, match="follow key schema v1"):
            SessionStore.open(config_for(tmp_path / "state", url))
    else:
        with SessionStore.open(config_for(tmp_path / "state", url), read_only=True) as store:
            assert store.key_schema == "v2"
            assert len(store.list_sessions()) == LANES


def test_lanes_that_cannot_tell_the_schema_record_the_configured_one(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    """Lanes without an origin key alike under either schema: an empty store records
    ``keys.schema`` (v1 here), a store that records one keeps it."""
    config = GatewayConfig.from_dict(
        {"keys": {"schema": "v1"}, **settings}, environ={"HERMES_HOME": str(tmp_path / "state")}
    )
    plugins = create_plugin_manager(config, load_entrypoints=False)
    lanes = []
    for lane in range(3):
        entry = _entry(lane).model_copy(update={"origin": None})
        lanes.append(ImportedLane(entry.to_dict(), session_row_from_entry(entry), []))
    (tmp_path / "state").mkdir()
    target = open_operator(config, write=True, plugins=plugins)
    try:
        counts = import_lanes(target, lanes[:2], config=config, plugins=plugins, batch=1)
        assert counts.lanes == 2
        assert target.get_meta(KEY_SCHEMA_META) == "v1"
        target.set_meta(KEY_SCHEMA_META, "v2")
        import_lanes(target, lanes, config=config, plugins=plugins)
        assert target.get_meta(KEY_SCHEMA_META) == "v2"
    finally:
        target.close()
