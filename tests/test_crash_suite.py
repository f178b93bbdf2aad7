"""The crash suite (SPEC §7.12): for every crash point the driver reaches, a real subprocess is
killed by SIGKILL at that point, restarted (twice), and the promises of SPEC §7 are checked:
no acknowledged message lost, each reply delivered at most once plus at most one marked re-send,
no turn resumed twice, nothing left ``resume_pending``. A table of the runs is printed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import CRASH_TABLE
from hermes_core import GatewayConfig, MessageEvent, SessionSource
from hermes_core.ledger import RESTART_PREFIX
from hermes_core.resume import resume_note
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager

DRIVER = Path(__file__).parent / "support" / "crash_driver.py"

# (crash point, driver mode): the points this file-driven gateway passes through.
POINTS = [
    ("marker_written", "run"),
    ("user_stored", "run"),
    ("reply_stored", "run"),
    ("obligation_recorded", "run"),
    ("sent", "run"),
    ("delivered", "run"),
    ("marker_cleared", "run"),
    ("recovery_done", "run"),
    ("clean_shutdown_written", "run"),
    ("drain_marked", "drain"),
    ("drain_timed_out", "drain"),
]


def _events() -> list[MessageEvent]:
    def event(chat: str, text: str, message_id: str) -> MessageEvent:
        source = SessionSource(platform="telegram", chat_id=chat, user_id=f"u{chat}")
        return MessageEvent(source=source, text=text, message_id=message_id)

    return [event("1", "first question", "m1"), event("2", "hello there", "m2"),
            event("1", "second question", "m3")]  # fmt: skip


def _run(workdir: Path, home: Path, mode: str, crash_at: str | None) -> int:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    environ["HERMES_HOME"] = str(home)
    if crash_at:
        environ["HERMES_CRASH_AT"] = crash_at
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(workdir), mode],
        env=environ, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"driver failed ({done.returncode}):\n{done.stderr}")
    return done.returncode


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@pytest.mark.parametrize(("point", "mode"), POINTS, ids=[point for point, _ in POINTS])
def test_crash_point(point: str, mode: str, tmp_path: Path) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    events = _events()
    with (workdir / "inbox.jsonl").open("w", encoding="utf-8") as inbox:
        for event in events:
            inbox.write(json.dumps(event.to_dict()) + "\n")

    assert _run(workdir, home, mode, point) == -signal.SIGKILL, f"{point} was never reached"
    restarts = 0
    for _ in range(2):  # a gateway restarted twice in a row never resumes a turn twice
        assert _run(workdir, home, "run", None) == 0
        restarts += 1

    acked = {record["event_id"] for record in _lines(workdir / "acks.jsonl")}
    deliveries = _lines(workdir / "outbox.jsonl")
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    with SessionStore.open(config, plugins=fresh_plugin_manager(home)) as store:
        lost = 0
        duplicates = 0
        for event in events:
            entry = store.lookup_by_session_key(store.session_key_for(event.source))
            assert entry is not None
            assert not entry.resume_pending, f"{entry.session_key} left resume_pending"
            assert entry.active_turn_token is None
            transcript = store.load_transcript(entry.session_id)
            users = [m for m in transcript if m["role"] == "user"]
            stored = [m for m in users if m.get("platform_message_id") == event.message_id]
            if event.event_id in acked and not stored:
                lost += 1
            assert len(stored) <= 1, f"{event.text!r} stored twice"
            reply = f"echo: {event.text}"
            plain = sum(1 for d in deliveries if d["text"] == reply)
            marked = sum(1 for d in deliveries if d["text"] == f"{RESTART_PREFIX}\n\n{reply}")
            assert plain + marked >= 1, f"{event.text!r} was never answered"
            assert plain <= 1, f"{event.text!r} delivered plainly {plain} times"
            assert marked <= 1, f"{event.text!r} re-sent {marked} times"
            duplicates += plain + marked - 1
            notes = Counter(
                m["content"] for m in users if str(m.get("content", "")).startswith("[System note")
            )
            assert all(count == 1 for count in notes.values()), "a turn was resumed twice"
        assert lost == 0
    assert acked == {event.event_id for event in events}
    CRASH_TABLE.append((point, restarts, len(acked), lost, duplicates))


def test_resume_note_names_the_interruption() -> None:
    assert "by a gateway shutdown before" in resume_note("shutdown_timeout", synthesized=True)
    assert "by a gateway interruption before" in resume_note(
        "restart_interrupted", synthesized=False
    )


def test_stuck_loop_suspends_after_three_interrupted_restarts(tmp_path: Path) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    event = _events()[0]
    (workdir / "inbox.jsonl").write_text(json.dumps(event.to_dict()) + "\n", encoding="utf-8")
    counts = home / "restart_counts.json"
    key = "agent:main:telegram:dm:1"
    # The turn and each automatic resume of it die at the same point.
    assert _run(workdir, home, "run", "marker_written") == -signal.SIGKILL
    for expected in (1, 2):
        assert _run(workdir, home, "run", "marker_written") == -signal.SIGKILL
        assert json.loads(counts.read_text()) == {key: expected}
    assert _run(workdir, home, "run", "marker_written") == 0  # third strike: suspended, no resume
    assert not counts.exists()
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    with SessionStore.open(config, plugins=fresh_plugin_manager(home)) as store:
        stuck = store.lookup_by_session_key(key)
        assert stuck is not None
        assert stuck.suspended
        fresh = store.get_or_create_session(event.source)
        assert fresh.session_id != stuck.session_id
        assert (fresh.was_auto_reset, fresh.auto_reset_reason) == (True, "suspended")


def test_a_successful_turn_resets_the_strike_count(tmp_path: Path) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    event = _events()[0]
    (workdir / "inbox.jsonl").write_text(json.dumps(event.to_dict()) + "\n", encoding="utf-8")
    assert _run(workdir, home, "run", "marker_written") == -signal.SIGKILL
    assert _run(workdir, home, "run", "marker_cleared") == -signal.SIGKILL  # resumed, succeeded
    assert not (home / "restart_counts.json").exists()
    assert _run(workdir, home, "run", None) == 0
    assert not (home / "restart_counts.json").exists()
