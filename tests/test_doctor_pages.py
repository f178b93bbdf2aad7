"""``doctor`` walks the routing table a page at a time: its findings are the same whether the
rows fit in one page or span many (SQLite and PostgreSQL), and its progress bar is drawn on a
terminal but not with ``--json``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from support.terminal import Terminal

from hermes_core.cli.doctor import run_checks
from hermes_core.cli.main import main
from hermes_core.config.schema import GatewayConfig
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.testing import telegram_dm

LANES = 14


def damaged_store(home: Path, settings: dict[str, Any]) -> GatewayConfig:
    """Lanes whose damage spans the table: seven with junk entry_json, two whose session
    ended, one whose session is gone, one routed to a session that does not exist, one
    deleted from the routing table (sessions.json, on SQLite, still names it)."""
    config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})
    with SessionStore.open(config) as store:
        keys = [store.get_or_create_session(telegram_dm(str(100 + n))).session_key
                for n in range(LANES)]  # fmt: skip
    statements = [
        *(("UPDATE gateway_routing SET entry_json = 'junk' WHERE session_key = :key", key)
          for key in keys[0:14:2]),
        *(("UPDATE sessions SET ended_at = 1 WHERE session_key = :key", key) for key in keys[3:5]),
        ("DELETE FROM sessions WHERE session_key = :key", keys[7]),
        ("UPDATE gateway_routing SET session_id = 'nowhere' WHERE session_key = :key", keys[9]),
        ("DELETE FROM gateway_routing WHERE session_key = :key", keys[13]),
    ]  # fmt: skip
    engine = create_engine(config.storage_url)
    with engine.begin() as conn:
        for statement, key in statements:
            conn.execute(text(statement), {"key": key})
    engine.dispose()
    return config


def test_findings_are_the_same_in_one_page_or_many(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    config = damaged_store(tmp_path / "state", settings)
    plugins = create_plugin_manager(config, check=False)
    reports = {
        page: [asdict(finding) for finding in run_checks(config, plugins, quiet=True, page=page)[0]]
        for page in (1000, 3, 1)
    }
    assert reports[3] == reports[1000] == reports[1]
    found = {finding["check"]: finding for finding in reports[1]}
    assert found["stored rows"]["status"] == "problem"
    assert found["stored rows"]["detail"].count("is not a JSON object") == 5
    assert found["stored rows"]["detail"].endswith("(and 2 more)")  # of seven
    assert found["routing"]["status"] == "warn"
    assert found["routing"]["detail"].count("which has ended") == 2
    assert found["routing"]["detail"].count("which does not exist") == 2
    if not settings:  # sessions.json is written for SQLite
        assert found["mirror"]["detail"].endswith("disagrees with the routing table on 2 lane(s)")


def test_progress_is_drawn_on_a_terminal_and_not_with_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    with SessionStore.open(config) as store:
        for n in range(3):
            store.get_or_create_session(telegram_dm(str(n)))
    for extra, drawn in (((), True), (("--json",), False)):
        terminal = Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert main(["doctor", "--state-dir", str(home), *extra]) == 0
        assert ("doctor: routing [" in terminal.getvalue()) is drawn
        assert ("3/3" in terminal.getvalue()) is drawn
    assert json.loads(capsys.readouterr().out.split("verdict: healthy\n")[-1])["healthy"]
