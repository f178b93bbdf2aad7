"""``hermes-sessions migrate``: SQLite to PostgreSQL and back with identical exports, and a
migration killed midway (SIGKILL of a real child process) that resumes."""

from __future__ import annotations

import json
import signal
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from support.killing import dies_after, run_killed
from support.populate import config_for, populate
from support.terminal import Terminal

from conftest import builtins_only
from hermes_core.cli.common import Progress, open_operator
from hermes_core.cli.main import main
from hermes_core.cli.migrate import MigrationMismatchError, verify
from hermes_core.store import SessionStore
from hermes_core.testing import telegram_dm
from hermes_plugins.sql_store.backend import SqlBackend


def export(capsys: pytest.CaptureFixture[str], *where: str) -> str:
    assert main(["export", *where]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_sqlite_to_postgresql_and_back_keeps_everything(
    tmp_path: Path, empty_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    before = export(capsys, "--state-dir", str(home))
    assert main(["migrate", "--state-dir", str(home), "--to", empty_database]) == 0
    assert "verified: row counts and checksums match" in capsys.readouterr().out
    assert export(capsys, "--url", empty_database) == before
    back = tmp_path / "back"
    back.mkdir(mode=0o700)
    assert main(["migrate", "--url", empty_database, "--to", f"sqlite:///{back}/state.db"]) == 0
    capsys.readouterr()
    assert export(capsys, "--url", f"sqlite:///{back}/state.db") == before
    with SessionStore.open(config_for(home, empty_database)) as store:  # usable after the move
        assert len(store.search("zebra")) == 6
        assert len(store.dead_letters()) == 1
        entry = store.list_sessions()[0]
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "new one"})
        assert len(store.search("new")) == 1


def test_migrate_refuses_an_unreachable_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    assert main(["migrate", "--state-dir", str(home), "--to", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "127.0.0.1" in err


KILLED_AFTER_A_BATCH = dies_after(
    "hermes_plugins.sql_store.backend:SqlBackend.insert_missing", 1, when="args[0] == 'messages'"
)
"""The migration's child process dies once the first batch of messages is committed in the
target: before the next one."""


@pytest.fixture
def targets(tmp_path: Path) -> str:
    """The URL prefix of SQLite targets in a private directory (``targets + "name.db"``)."""
    (tmp_path / "targets").mkdir(mode=0o700)
    return f"sqlite:///{tmp_path}/targets/"


def populate_batches(tmp_path: Path, url: str | None = None) -> Path:
    """A state directory whose store (or ``url``'s) is :func:`populate`'d, then given 1,200 more
    messages on one lane (1,212 in all: three batches of the copy)."""
    home = tmp_path / "state"
    populate(home, url)
    with SessionStore.open(config_for(home, url)) as store:
        entry = store.list_sessions()[0]
        for i in range(1200):
            store.append_to_transcript(entry.session_id, {"role": "user", "content": f"m {i}"})
    return home


def killed_midway(argv: list[str]) -> int:
    """Run ``migrate ARGV`` until the first batch of messages is committed in its target (the
    last argument), then kill it; the messages the target holds."""
    status = run_killed(KILLED_AFTER_A_BATCH, ["migrate", *argv], builtins_only())
    assert status == -signal.SIGKILL
    engine = create_engine(argv[-1])
    with engine.connect() as conn:
        copied = int(conn.exec_driver_sql("SELECT count(*) FROM messages").scalar_one())
    engine.dispose()
    return copied


def migrated(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict[str, int]]:
    """``migrate ARGS --json``'s report (records copied now and verified, per kind)."""
    assert main(["migrate", *argv, "--json"]) == 0
    report: dict[str, dict[str, int]] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.slow
@pytest.mark.parametrize(("source_on", "target_on"), [
    ("sqlite", "sqlite"), ("sqlite", "postgresql"), ("postgresql", "sqlite"),
])  # fmt: skip
def test_a_migration_killed_midway_resumes_to_what_an_uninterrupted_one_copies(
    tmp_path: Path, targets: str, source_on: str, target_on: str,
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    postgresql = "postgresql" in (source_on, target_on)
    database = str(request.getfixturevalue("empty_database")) if postgresql else None
    source_url = database if source_on == "postgresql" else None
    home = populate_batches(tmp_path, source_url)
    source = ["--state-dir", str(home), *(["--url", source_url] if source_url else [])]
    target = targets + "killed.db"
    if database is not None and target_on == "postgresql":
        target = database
    copied = killed_midway([*source, "--to", target])
    assert 0 < copied < 1212
    before = export(capsys, *source)

    resumed = migrated(capsys, *source, "--to", target)
    whole = migrated(capsys, *source, "--to", targets + "whole.db")

    assert resumed["verified"] == whole["verified"] == whole["copied"]
    assert resumed["copied"]["messages"] == whole["copied"]["messages"] - copied
    assert resumed["copied"]["sessions"] == 0
    assert export(capsys, "--url", target) == before
    assert export(capsys, "--url", targets + "whole.db") == before
    assert migrated(capsys, *source, "--to", target)["copied"] == dict.fromkeys(whole["copied"], 0)


@pytest.mark.slow
def test_a_resumed_migration_reads_each_message_once_and_takes_what_the_source_gained(
    tmp_path: Path, targets: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    home = populate_batches(tmp_path)
    source, target = ["--state-dir", str(home)], targets + "killed.db"
    assert killed_midway([*source, "--to", target]) == 500
    with SessionStore.open(config_for(home)) as store:  # the gateway ran again meanwhile
        copied_before = store.list_sessions()[-1]  # a session the killed run copied
        entry = store.get_or_create_session(telegram_dm("new"))
        for session_id in (entry.session_id, copied_before.session_id):
            store.append_to_transcript(session_id, {"role": "user", "content": "since"})
    read: Counter[str] = Counter()
    table_rows = SqlBackend.table_rows

    def counted(self: SqlBackend, name: str, after: Any, limit: int) -> list[dict[str, Any]]:
        rows = table_rows(self, name, after, limit)
        read[name] += len(rows)
        return rows

    monkeypatch.setattr(SqlBackend, "table_rows", counted)
    report = migrated(capsys, *source, "--to", target)
    monkeypatch.undo()

    assert report["verified"]["messages"] == 1214  # the copied session's count set again
    assert report["copied"]["messages"] == 714
    assert read["messages"] == 1214  # the 500 copied compared, the rest copied: each read once
    assert (report["copied"]["sessions"], report["copied"]["gateway_routing"]) == (1, 4)
    assert export(capsys, "--url", target) == export(capsys, *source)
    with sqlite3.connect(home / "state.db") as raw:  # a copied row changed in the source
        raw.execute("UPDATE messages SET content = 'changed' WHERE id = 3")
    assert main(["migrate", *source, "--to", target]) == 2
    assert "1 row(s) of its table messages are not rows of this one" in capsys.readouterr().err


def test_the_progress_bar_counts_rows_on_a_terminal_and_stays_quiet_with_json(
    tmp_path: Path, targets: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    home = tmp_path / "state"
    populate(home)
    for json_output, name in ((True, "quiet"), (False, "shown")):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        argv = [
            "migrate",
            "--state-dir",
            str(home),
            "--to",
            f"{targets}{name}.db",
        ]
        assert main([*argv, *(["--json"] if json_output else [])]) == 0
        if json_output:
            assert terminal.getvalue() == ""
            rows = sum(json.loads(capsys.readouterr().out)["verified"].values())
        else:
            assert terminal.getvalue().endswith(f"] {rows:,}/{rows:,}\n")  # rows, not tables
    capsys.readouterr()


def test_a_million_advances_redraw_only_as_the_clock_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(10**7))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock) * 0.001)  # 1 ms a call
    terminal = Terminal()
    bar = Progress("migrate", 10**6, terminal)
    for _ in range(10**6):
        bar.advance()
    bar.close()
    draws = terminal.getvalue().count("\r")
    assert 5_000 < draws < 20_000  # a draw per 100 calls of the clock, not one per advance
    assert terminal.getvalue().endswith("] 1,000,000/1,000,000\n")
    quiet = Terminal()
    silent = Progress("migrate", 10, quiet, quiet=True)
    silent.advance(10)
    silent.close()
    assert quiet.getvalue() == ""


def test_verification_tells_a_changed_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    (tmp_path / "copy").mkdir(mode=0o700)
    copy = f"sqlite:///{tmp_path}/copy/state.db"
    report = migrated(capsys, "--state-dir", str(home), "--to", copy)
    source = open_operator(config_for(home), write=False, plugins=None)
    target = open_operator(config_for(home, copy), write=False, plugins=None)
    try:
        assert verify(source, target) == report["verified"]
        with sqlite3.connect(tmp_path / "copy" / "state.db") as raw:
            raw.execute("UPDATE messages SET content = 'changed' WHERE id = 3")
        with pytest.raises(MigrationMismatchError, match="table messages differs"):
            verify(source, target)
    finally:
        source.close()
        target.close()
