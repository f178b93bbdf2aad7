"""``hermes-sessions doctor`` on a healthy store and on each kind of damage it knows, with and
without ``--fix``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.populate import config_for, populate

from conftest import FakeDistribution, builtins_only
from hermes_core.cli.main import main
from hermes_core.store import SessionStore
from hermes_core.store.replay import encode_message_line


def doctor(capsys: pytest.CaptureFixture[str], home: Path, *extra: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["doctor", "--json", "--state-dir", str(home), *extra])
    return code, json.loads(capsys.readouterr().out)


def statuses(report: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return {f["check"]: f["status"] for f in report["findings"] if f["status"] != "fixed"}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "state"
    populate(home)
    return home


def test_a_healthy_store_exits_0(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = doctor(capsys, home)
    assert code == 0
    assert report["healthy"] is True
    assert set(statuses(report).values()) <= {"ok", "warn"}
    assert main(["doctor", "--state-dir", str(home)]) == 0
    assert capsys.readouterr().out.endswith("verdict: healthy\n")


def test_a_broken_fts_index_is_found_and_rebuilt(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = sqlite3.connect(home / "state.db")
    raw.execute("UPDATE messages_fts_data SET block = x'" + "ff" * 16 + "' WHERE id > 1")
    raw.commit()
    raw.close()
    code, report = doctor(capsys, home)
    assert code == 1
    assert statuses(report)["fts"] == "problem"
    code, report = doctor(capsys, home, "--fix")
    assert code == 0
    assert "rebuilt the full-text index" in report["fixed"]
    with SessionStore.open(config_for(home), read_only=True) as store:
        assert len(store.search("zebra")) == 6


def test_a_torn_sessions_json_is_rewritten(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mirror = home / "sessions" / "sessions.json"
    whole = json.loads(mirror.read_text())
    mirror.write_bytes(mirror.read_bytes()[:120])
    code, report = doctor(capsys, home)
    assert code == 1
    assert statuses(report)["mirror"] == "problem"
    code, report = doctor(capsys, home, "--fix")
    assert code == 0
    assert json.loads(mirror.read_text()).keys() == whole.keys()


KILLED_MID_REBUILD = """
import os, signal, sys
from hermes_core.cli.main import main
from hermes_plugins.sql_store.dialects.sqlite_search import Fts5Index

def die(self):  # the index was emptied and committed; none of it is refilled yet
    os.kill(os.getpid(), signal.SIGKILL)

Fts5Index.index_backlog = die
sys.exit(main(["doctor", "--fix", "--state-dir", sys.argv[1]]))
"""


def test_a_fix_killed_mid_rebuild_is_safe_to_run_again(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fix`` killed while it rebuilds the index leaves it consistent (it holds what its
    watermark covers, search scans the rest): the next run finds the store healthy and search
    finds every message."""
    raw = sqlite3.connect(home / "state.db")
    raw.execute("UPDATE messages_fts_data SET block = x'" + "ff" * 16 + "' WHERE id > 1")
    raw.commit()
    raw.close()
    child = subprocess.run(
        [sys.executable, "-c", KILLED_MID_REBUILD, str(home)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=builtins_only(), check=False,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL
    for extra in ((), ("--fix",)):
        code, report = doctor(capsys, home, *extra)
        assert code == 0
        assert statuses(report)["fts"] == "ok"
        with SessionStore.open(config_for(home), read_only=True) as store:
            assert len(store.search("zebra")) == 6


def test_past_the_mirror_limit_an_old_sessions_json_is_outdated_and_removed(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mirror = home / "sessions" / "sessions.json"
    lanes = len(json.loads(mirror.read_text())) - 1
    (home / "config.yaml").write_text(
        f"gateway: {{sessions_json_max_lanes: {lanes - 1}}}\n", encoding="utf-8"
    )
    code, report = doctor(capsys, home)
    assert code == 1
    finding = next(f for f in report["findings"] if f["check"] == "mirror")
    assert finding["status"] == "problem"
    assert "more than gateway.sessions_json_max_lanes" in finding["detail"]
    code, report = doctor(capsys, home, "--fix")
    assert not mirror.exists()
    code, report = doctor(capsys, home)
    assert code == 0
    assert statuses(report)["mirror"] == "ok"


def test_a_0644_database_is_tightened(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(home / "state.db", 0o644)
    code, report = doctor(capsys, home)
    assert code == 1
    problem = next(f for f in report["findings"] if f["check"] == "files")
    assert "has mode 0644, not 0600" in problem["detail"]
    code, _ = doctor(capsys, home, "--fix")
    assert code == 0
    assert (home / "state.db").stat().st_mode & 0o777 == 0o600


def test_a_degraded_mode_backlog_is_replayed(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SessionStore.open(config_for(home), read_only=True) as store:
        entry = store.list_sessions()[0]
        before = len(store.load_transcript(entry.session_id))
    backlog = home / "sessions" / f"{entry.session_id}.jsonl"
    fd = os.open(backlog, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, encode_message_line({"role": "user", "content": "written while degraded"}))
    os.close(fd)
    code, report = doctor(capsys, home)
    assert code == 1
    assert statuses(report)["backlog"] == "problem"
    code, report = doctor(capsys, home, "--fix")
    assert code == 0
    with SessionStore.open(config_for(home), read_only=True) as store:
        contents = [m["content"] for m in store.load_transcript(entry.session_id)]
    assert len(contents) == before + 1
    assert contents[-1] == "written while degraded"


def test_fix_refuses_while_the_store_is_held(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SessionStore.open(config_for(home)):
        assert main(["doctor", "--state-dir", str(home)]) == 0  # checking works beside it
        capsys.readouterr()
        os.chmod(home / "state.db", 0o644)
        assert main(["doctor", "--fix", "--state-dir", str(home)]) == 2
        assert "holds the store" in capsys.readouterr().err
    assert (home / "state.db").stat().st_mode & 0o777 == 0o644  # nothing was changed


def test_a_corrupt_database_gets_the_procedure_and_no_change(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = home / "state.db"
    data = bytearray(database.read_bytes())
    data[100:4096] = b"\x00" * (4096 - 100)  # the schema page is gone
    database.write_bytes(bytes(data))
    code, report = doctor(capsys, home, "--fix")
    assert code == 1
    bad = [f for f in report["findings"] if f["status"] == "problem"]
    assert any("state.db.corrupt-" in (f["fix"] or "") for f in bad)
    assert database.read_bytes() == bytes(data)


_SECOND_TELEGRAM = """
from hermes_core import PlatformSpec, hookimpl

@hookimpl
def hermes_register_platforms(config):
    return [PlatformSpec(name="telegram")]
"""
_SECOND_SQLITE = """
from hermes_core import StoreSpec, hookimpl

@hookimpl
def hermes_register_stores(config):
    return [StoreSpec(name="other", schemes=("sqlite",), open=lambda url, config: None)]
"""


@pytest.mark.parametrize(
    ("module", "claim"),
    [(_SECOND_TELEGRAM, "platform 'telegram'"), (_SECOND_SQLITE, "storage scheme 'sqlite'")],
)
def test_a_plugin_conflict_is_a_finding_naming_both_plugins_and_the_fix(
    home: Path, capsys: pytest.CaptureFixture[str], fake_distribution: FakeDistribution,
    module: str, claim: str,
) -> None:  # fmt: skip
    fake_distribution(
        "hermes-dup", entry_points={"dup": "dup_plugin"}, modules={"dup_plugin": module}
    )
    code, report = doctor(capsys, home)
    assert code == 1
    conflict = next(f for f in report["findings"] if f["check"] == "plugins")
    assert conflict["status"] == "problem"
    assert claim in conflict["detail"]
    assert "(hermes-sessions)" in conflict["detail"]
    assert "'dup' (hermes-dup)" in conflict["detail"]
    assert "plugins.disable: [" in conflict["detail"]
    assert main(["doctor", "--state-dir", str(home)]) == 1
    out = capsys.readouterr().out
    assert f"problem  plugins: {claim} is registered by plugin" in out
    assert out.endswith("problem(s)\n")
