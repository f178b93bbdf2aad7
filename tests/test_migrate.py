"""``hermes-sessions migrate``: SQLite to PostgreSQL and back with identical exports, and a
migration killed midway (SIGKILL of a real child process) that resumes."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.populate import config_for, populate

from conftest import builtins_only
from hermes_core.cli.main import main
from hermes_core.store import SessionStore


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


KILLED_AFTER_A_BATCH = """
import os, signal, sys
from hermes_core.cli.main import main
from hermes_plugins.sql_store.backend import SqlBackend

insert_missing = SqlBackend.insert_missing

def insert_then_die(self, name, rows):
    inserted = insert_missing(self, name, rows)
    if name == "messages":  # the first batch of messages is committed: die before the next
        os.kill(os.getpid(), signal.SIGKILL)
    return inserted

SqlBackend.insert_missing = insert_then_die
sys.exit(main(["migrate", "--state-dir", sys.argv[1], "--to", sys.argv[2]]))
"""
"""``hermes-sessions migrate`` in a child process that SIGKILLs itself once the first batch of
messages is committed in the target: a kill midway, whatever the machine's load (a kill timed
from outside could come after the copy had finished)."""


@pytest.mark.slow
def test_a_migration_killed_midway_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    with SessionStore.open(config_for(home)) as store:
        entry = store.list_sessions()[0]
        for i in range(1200):  # three batches of messages
            store.append_to_transcript(entry.session_id, {"role": "user", "content": f"m {i}"})
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    database = target / "state.db"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_A_BATCH, str(home), f"sqlite:///{database}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=builtins_only(), check=False,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL
    with sqlite3.connect(database) as raw:
        assert 0 < raw.execute("SELECT count(*) FROM messages").fetchone()[0] < 1212
    before = export(capsys, "--state-dir", str(home))
    assert main(["migrate", "--state-dir", str(home), "--to", f"sqlite:///{database}"]) == 0
    capsys.readouterr()
    assert export(capsys, "--url", f"sqlite:///{database}") == before
