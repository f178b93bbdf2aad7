"""Operator commands never damage the store they work on (issue 30): a command that writes a
path refuses the store's own files and links to them, ``migrate`` refuses a target holding
another store, numbers from the command line must be finite; outputs are private, read-only
commands create nothing, and every error is one short line that echoes no secret."""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from support.populate import config_for, populate, run, where

from hermes_core.domain.errors import InvalidValueError
from hermes_core.store import SessionStore

STORE_FILES = (
    "state.db", "state.db-wal", "state.db-shm", "state.db.lock", "sessions/sessions.json",
    "sessions/20261130_000000_00000000.jsonl", "gateway.lock",
)  # fmt: skip
SQLITE_ONLY = ("state.db", "state.db-wal", "state.db-shm", "state.db.lock")
BAD_NUMBERS = ("nan", "inf", "-inf", "1e308", "9" * 400)


def exported(capsys: pytest.CaptureFixture[str], home: Path, url: str | None) -> str:
    code, out, err = run(capsys, "export", *where(home, url))
    assert (code, err) == (0, "")
    return out


def one_error_line(code: int, out: str, err: str, text: str) -> None:
    assert (code, out) == (2, "")
    assert err.startswith("hermes-sessions: error: ")
    assert err.count("\n") == 1
    assert text in err


@pytest.fixture
def running(tmp_path: Path, url: str | None) -> Iterator[tuple[Path, SessionStore]]:
    """A populated state directory whose store is held open for writing, as by a running
    gateway (so SQLite's -wal and -shm exist and hold frames), with a gateway lock file and a
    degraded-mode transcript."""
    home = tmp_path / "state"
    populate(home, url)
    with SessionStore.open(config_for(home, url)) as store:
        entry = store.list_sessions()[0]
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "in the wal"})
        (home / "gateway.lock").write_text('{"pid": 1}')
        (home / STORE_FILES[5]).write_text('{"role": "user", "content": "backlog"}\n')
        mirror = home / "sessions" / "sessions.json"  # not written for PostgreSQL: an old one
        if not mirror.exists():
            mirror.write_text("{}")
        if url is None:  # the store's checkpoint thread copies the WAL in its own time: now,
            # so that state.db changes no more while a test compares its bytes (the WAL keeps
            # its frames)
            with closing(sqlite3.connect(home / "state.db", timeout=10)) as conn:
                conn.execute("PRAGMA wal_checkpoint(FULL)")
        yield home, store


@pytest.mark.slow
@pytest.mark.parametrize("via", ["path", "symlink", "hardlink"])
@pytest.mark.parametrize("name", STORE_FILES)
@pytest.mark.parametrize("command", ["export", "migrate"])
def test_writing_commands_refuse_the_stores_own_files(
    running: tuple[Path, SessionStore], url: str | None, command: str, name: str, via: str,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    home, store = running
    if url is not None and name in SQLITE_ONLY:
        pytest.skip("the store is on PostgreSQL: state.db is not one of its files")
    target = home / name
    assert target.is_file()
    if via == "symlink":
        (tmp_path / "link").symlink_to(target)
        target = tmp_path / "link"
    elif via == "hardlink":
        os.link(target, tmp_path / "hard")
        target = tmp_path / "hard"
    files = {  # -shm is shared memory that every reader writes its marks to: only its size
        path: path.read_bytes() if path.suffix != ".db-shm" else path.stat().st_size
        for path in home.rglob("*")
        if path.is_file()
    }
    before = exported(capsys, home, url)
    argv = (
        ["export", "--output", str(target)]
        if command == "export"
        else ["migrate", "--to", f"sqlite:///{target}"]
    )
    one_error_line(*run(capsys, *argv, *where(home, url)), "is one of the store's own files")
    assert {
        path: path.read_bytes() if path.suffix != ".db-shm" else path.stat().st_size
        for path in files
    } == files
    entry = store.list_sessions()[0]  # the "gateway" goes on writing
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "after"})
    store.close()
    after = exported(capsys, home, url)
    assert _rows(before) < _rows(after)  # everything is still there, and the new message
    messages = [line for line in before.splitlines() if line.startswith('{"table": "messages"')]
    assert len(messages) == 13
    assert set(messages) < set(after.splitlines())


def _rows(export: str) -> set[tuple[str, str]]:
    """The (table, row id or key) of every exported row."""
    records = [json.loads(line) for line in export.splitlines()]
    return {(r["table"], str(r["row"].get("id", r["row"].get("session_key")))) for r in records}


@pytest.mark.slow
def test_migrate_refuses_a_target_holding_another_store(
    tmp_path: Path, url: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    home, other = tmp_path / "state", tmp_path / "other"
    populate(home)
    populate(other, url)  # another store, on SQLite or PostgreSQL
    target = url or f"sqlite:///{other}/state.db"
    there = ["--state-dir", str(other), "--url", target]
    source_before = exported(capsys, home, None)
    target_before = run(capsys, "export", *there)[1]
    files = {path: path.read_bytes() for path in other.glob("state.db*")}  # not even the lock
    one_error_line(
        *run(capsys, "migrate", "--state-dir", str(home), "--to", target),
        "the target already holds another store",
    )
    assert run(capsys, "export", *there)[1] == target_before
    assert exported(capsys, home, None) == source_before
    assert {path: path.read_bytes() for path in files} == files
    itself = "the store to migrate from" if url else "is one of the store's own files"
    one_error_line(*run(capsys, "migrate", *there, "--to", target), itself)
    assert run(capsys, "export", *there)[1] == target_before


@pytest.mark.slow
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_numbers_from_the_command_line_must_be_finite(
    tmp_path: Path, url: str | None, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home, url)
    before = exported(capsys, home, url)
    for argv in (["prune", f"--days={value}"], ["prune", f"--days={value}", "--dry-run"],
                 ["ls", f"--active={value}"]):  # fmt: skip
        one_error_line(*run(capsys, *argv, *where(home, url)), "must be a number of")
    assert exported(capsys, home, url) == before
    with SessionStore.open(config_for(home, url)) as store:
        for bad in (math.nan, math.inf, 1e308):
            with pytest.raises(InvalidValueError, match="max_age_days"):
                store.prune_old_entries(bad)
            with pytest.raises(InvalidValueError, match="active_minutes"):
                store.list_sessions(bad)
        assert len(store.list_sessions()) == 3


@pytest.mark.slow
def test_export_output_is_private_and_write_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    previous = os.umask(0o022)
    try:
        code, _, _ = run(capsys, "export", "--state-dir", str(home), "-o", str(tmp_path / "x"))
    finally:
        os.umask(previous)
    assert code == 0
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o600
    assert (tmp_path / "x").read_text().count("\n") > 10
    one_error_line(*run(capsys, "export", "--state-dir", str(home), "-o", "/dev/full"),
                   "No space left on device")  # fmt: skip
    one_error_line(*run(capsys, "export", "--state-dir", str(home), "-o", str(tmp_path)),
                   "cannot write")  # fmt: skip
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    script = Path(sys.executable).with_name("hermes-sessions")
    done = subprocess.run(
        [str(script), "export", "--state-dir", str(home), "-o", str(fifo)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    one_error_line(done.returncode, done.stdout, done.stderr, "a FIFO without a reader")


def test_read_only_commands_create_nothing_in_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.delenv("HERMES_HOME")
    assert run(capsys, "ls")[0] == 2  # no store at ~/.hermes/state.db
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    assert run(capsys, "ls", "--url", url)[0] == 2  # unreachable
    assert run(capsys, "doctor")[0] == 1
    assert list(user.iterdir()) == []


def test_show_opens_an_ended_session(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "state"
    keys = populate(home)
    args = ["--state-dir", str(home)]
    _, out, _ = run(capsys, "reset", keys["alice"], *args, "--json")
    ended, current = json.loads(out)["ended"], json.loads(out)["session_id"]
    _, out, _ = run(capsys, "search", "zebra", *args, "--json")
    assert ended in {hit["session_id"] for hit in json.loads(out)}
    code, out, _ = run(capsys, "show", ended, *args, "--json")
    shown = json.loads(out)
    assert code == 0
    assert shown["session"]["session_key"] == keys["alice"]
    assert shown["session"]["end_reason"] == "session_reset"
    assert shown["lane_session_id"] == current
    assert [m["content"] for m in shown["transcript"]][:1] == ["hello from alice"]
    code, out, _ = run(capsys, "show", ended, *args)
    assert code == 0
    assert f"session:  {ended}" in out
    assert "user: the zebra of alice" in out


def test_errors_are_short_and_echo_no_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "state"
    populate(home)
    huge = "x" * 2_000_000
    for argv in (["show", huge, "--state-dir", str(home)],
                 ["key", "--platform", "telegram", "--chat-id", huge],
                 ["key", "--platform", huge]):  # fmt: skip
        code, _, err = run(capsys, *argv)
        assert code == 2
        assert len(err) < 1000
        assert "characters)" in err
    code, _, err = run(capsys, "ls", "--url", "postgres:s3cret@db.example/hermes")
    assert code == 2
    assert "s3cret" not in err
    shared = Path("/tmp")  # world-writable and sticky: never to be chmod-ed
    database = shared / f"hermes-guard-{os.getpid()}.db"
    with caplog.at_level(logging.WARNING):
        code, _, _ = run(
            capsys, "migrate", "--state-dir", str(home), "--to", f"sqlite:///{database}"
        )
    for suffix in ("", "-wal", "-shm", ".lock"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    assert code == 0
    assert "chmod 700 /tmp" not in caplog.text
    assert "a directory of its own" in caplog.text


def test_a_symlinked_sessions_directory_is_refused_like_a_symlinked_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home, outside = tmp_path / "state", tmp_path / "outside"
    populate(home)
    (home / "sessions").rename(outside)
    outside.chmod(0o755)
    (home / "sessions").symlink_to(outside)
    one_error_line(*run(capsys, "ls", "--state-dir", str(home)), "is a symlink")
    code, out, _ = run(capsys, "doctor", "--fix", "--state-dir", str(home))
    assert code == 1
    assert "sessions is a symlink" in out
    assert "verdict: 1 problem(s)" in out
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755  # never followed


def test_junk_routing_rows_are_skipped_and_reported_by_doctor(
    tmp_path: Path, url: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    keys = populate(home, url)
    _corrupt(home, url, keys)
    code, out, err = run(capsys, "ls", *where(home, url), "--json")
    assert code == 0
    assert err.count("\n") == 1  # one warning line for the lane it skips
    assert "cannot be loaded" in err
    lanes = {lane["session_key"]: lane for lane in json.loads(out)}
    assert keys["alice"] not in lanes  # its entry cannot be read
    assert keys["bob"] in lanes  # the junk time column leaves the entry's own
    code, out, _ = run(capsys, "doctor", *where(home, url), "--json")
    report = json.loads(out)
    assert code == 1
    problems = [f["detail"] for f in report["findings"] if f["check"] == "stored rows"]
    assert f"routing row {keys['alice']!r}: its entry_json is not a JSON object" in problems[0]
    assert f"routing row {keys['bob']!r}: its updated_at is not a time" in problems[0]
    assert "queued event #2 of" in problems[0]
    code, out, _ = run(capsys, "show", keys["topic"], *where(home, url), "--json")
    assert code == 0  # the lane whose dead letter cannot be read
    assert json.loads(out)["dead_letters"][0]["event"] is None


def _corrupt(home: Path, url: str | None, keys: dict[str, str]) -> None:
    """Junk ``entry_json`` in alice's routing row, a junk ``updated_at`` in bob's, a junk
    ``event_json`` in alice's dead letter, moved to the topic's lane (alice's is unreadable)."""
    statements = (
        ("UPDATE gateway_routing SET entry_json = 'junk' WHERE session_key = :key", keys["alice"]),
        ("UPDATE gateway_routing SET updated_at = 'NaN' WHERE session_key = :key", keys["bob"]),
        ("UPDATE queued_events SET event_json = '{', session_key = :key WHERE dead_at IS NOT NULL",
         keys["topic"]),
    )  # fmt: skip
    if url is None:
        with sqlite3.connect(home / "state.db") as raw:
            for sql, key in statements:
                raw.execute(sql, {"key": key})
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        for sql, key in statements:
            conn.execute(text(sql), {"key": key})
    engine.dispose()


WRITERS = (
    ("reset", "{key}"), ("suspend", "{key}"), ("resume", "{key}"), ("requeue", "--all"),
    ("drop", "--all"), ("prune", "--days", "1"), ("import-sessions-json", "{mirror}"),
    ("rekey", "--to", "v2"), ("doctor", "--fix"), ("migrate", "--to", "sqlite:///{copy}"),
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("linked", ["state.db", "sessions"])
@pytest.mark.parametrize("argv", WRITERS, ids=[argv[0] for argv in WRITERS])
def test_writing_commands_refuse_a_store_whose_files_are_symlinks(
    tmp_path: Path, linked: str, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """The store's database or sessions directory replaced by a symlink to one elsewhere:
    every writing command refuses it, and nothing behind the link changes."""
    home, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    keys = populate(home)
    saved = tmp_path / "saved.json"
    saved.write_bytes((home / "sessions" / "sessions.json").read_bytes())
    elsewhere.mkdir()
    (home / linked).rename(elsewhere / linked)
    (elsewhere / linked).chmod(0o755 if linked == "sessions" else 0o644)
    (home / linked).symlink_to(elsewhere / linked)
    before = _snapshot(elsewhere)
    values = {"key": keys["alice"], "mirror": str(saved), "copy": str(tmp_path / "copy.db")}
    code, _, err = run(capsys, *(part.format(**values) for part in argv), "--state-dir", str(home))
    if (argv[0], linked) != ("migrate", "sessions"):  # migrate never opens sessions/
        assert code in (1, 2)
        assert "symlink" in err or code == 1
    assert _snapshot(elsewhere) == before


def _snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Mode and content of every file under ``directory`` (and the modes of directories)."""
    return {
        str(path): (path.stat().st_mode, path.read_bytes() if path.is_file() else b"")
        for path in [directory, *sorted(directory.rglob("*"))]
    }
