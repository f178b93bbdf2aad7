"""A streamed reply's process killed by SIGKILL at every point of the stream, on SQLite and on
PostgreSQL (``support/stream_driver.py``): after the restart the chat holds exactly one message
with the finished reply (edited in place, marked as recovered when the restart finished it) or
the interrupted note and one resumed reply; never the whole reply twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.gateway_driver import configure, event
from support.stream_driver import REPLY

from hermes_core.gateway.streaming import CUT_PART, INTERRUPTED_NOTE, RECOVERED_NOTE
from hermes_core.turns.crashpoints import STREAM_CRASH_POINTS

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).parent / "support" / "stream_driver.py"
LIMIT = 80  # the driver's message limit: the reply (264 characters) takes four messages
TIMEOUT = 60
EDIT_INTERVAL = 0.03  # the driver streams a chunk every 0.01 s


def _run(workdir: Path, home: Path, crash_at: str | None) -> int:
    environ = {**os.environ, "HERMES_HOME": str(home)}
    environ.pop("HERMES_CRASH_AT", None)
    if crash_at:
        environ["HERMES_CRASH_AT"] = crash_at
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(workdir)], env=environ, timeout=TIMEOUT,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"the driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.returncode


def _chat(workdir: Path) -> list[str]:
    path = workdir / "chats.json"
    messages: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    return [str(message["text"]) for message in messages]


@pytest.fixture(params=["sqlite", "postgres"])
def places(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    url = str(request.getfixturevalue("empty_database")) if request.param == "postgres" else None
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    configure(home, url)
    settings = json.loads((home / "config.yaml").read_text())
    settings["streaming"] = {"edit_interval_secs": EDIT_INTERVAL}  # edits while it streams
    (home / "config.yaml").write_text(json.dumps(settings))
    message = event("5", "tell me a story", "m1")
    (workdir / "inbox.json").write_text(json.dumps(message.to_dict()))
    return workdir, home


@pytest.mark.parametrize("point", [*STREAM_CRASH_POINTS, "reply_stored", "sent", "marker_cleared"])
def test_a_stream_killed_at_each_point_shows_one_reply_after_the_restart(
    point: str, places: tuple[Path, Path]
) -> None:
    workdir, home = places
    assert _run(workdir, home, point) == -signal.SIGKILL
    assert (workdir / "acked").exists()  # stored before the kill: the restart owns the turn
    assert _run(workdir, home, None) == 0
    chat = _chat(workdir)
    whole = "".join(chat)
    assert whole.count("word23") == 1  # the end of the reply appears once: never twice
    assert all(len(text) <= LIMIT for text in chat)
    if INTERRUPTED_NOTE in chat:  # cut before the reply was stored: resumed once below it
        assert chat.index(INTERRUPTED_NOTE) == 0
        resumed = [text for text in chat[1:] if text != CUT_PART]
        assert "".join(resumed).strip() == REPLY.strip()
    elif RECOVERED_NOTE in whole:  # stored, finished by the restart in the same messages
        assert whole.replace(f"\n\n{RECOVERED_NOTE}", "").strip() == REPLY.strip()
    else:  # nothing was shown before the kill, or everything was delivered
        assert whole.strip() == REPLY.strip()
    assert _run(workdir, home, None) == 0  # a second restart changes nothing
    assert _chat(workdir) == chat
