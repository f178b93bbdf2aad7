"""Chat text never steers the operator's terminal: ``show``, ``search`` and ``export`` write a
user's escape sequences (window title, screen clear, colours, C1 controls) and bidi overrides as
visible escapes, while ``--json`` and the JSONL export keep the exact text once parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.populate import ALICE, config_for, populate

from hermes_core.cli.main import main
from hermes_core.domain.models import MessageEvent
from hermes_core.store import SessionStore

HOSTILE = (
    "zebra \x1b]0;pwned\x07 title \x1b[2J clear \x9b31m c1 \u202egnp.exe bidi \u2066iso\u2069"
    "\rover\nsecond line\x7f"
)
STEERING = ("\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\u2069", "\r", "\x7f")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "state"
    populate(home)
    with SessionStore.open(config_for(home)) as store:
        entry = store.get_or_create_session(ALICE)
        store.append_to_transcript(entry.session_id, {"role": "user", "content": HOSTILE})
        store._queue.add(entry.session_key, MessageEvent(source=ALICE, text=HOSTILE))
    return home


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _strings(data: object) -> list[str]:
    """Every string value in parsed JSON."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [text for value in data.values() for text in _strings(value)]
    if isinstance(data, list):
        return [text for value in data for text in _strings(value)]
    return []


def _inert(text: str) -> None:
    found = [char for char in STEERING if char in text]
    assert not found, found


def test_show_and_search_print_escapes_not_sequences(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ["--state-dir", str(home)]
    keys = json.loads(run(capsys, "ls", "--json", *where))
    alice = next(lane["session_key"] for lane in keys if lane["session_key"].endswith("c=1001"))
    out = run(capsys, "show", alice, *where)
    _inert(out)
    shown = (
        r"zebra \x1b]0;pwned\x07 title \x1b[2J clear \x9b31m c1 \u202egnp.exe bidi \u2066iso"
        r"\u2069\x0dover\x0asecond line\x7f"
    )
    assert f"user: {shown}" in out  # the transcript line, on one line
    assert f": {shown}" in out.split("dead letters:")[0]  # the queued event
    out = run(capsys, "search", "zebra", *where)
    _inert(out)
    assert r"\x1b]0;pwned" in out
    for command in (["show", alice], ["search", "zebra"]):
        out = run(capsys, *command, "--json", *where)
        _inert(out.replace("\n", " "))  # JSON's own line breaks are not content
        assert HOSTILE in _strings(json.loads(out))  # the exact text once parsed


def test_exports_write_escapes_markdown_keeps_its_lines(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ["--state-dir", str(home)]
    markdown = tmp_path / "out.md"
    run(capsys, "export", "--format", "markdown", "-o", str(markdown), *where)
    text = markdown.read_text(encoding="utf-8")
    _inert(text)
    assert r"\x1b[2J clear \x9b31m c1 \u202egnp.exe" in text
    assert r"\x0dover" + "\nsecond line" in text  # a message's own lines stay lines
    out = run(capsys, "export", *where)
    _inert(out.replace("\n", " "))
    rows = [json.loads(line)["row"] for line in out.splitlines()]
    assert HOSTILE in [row.get("content") for row in rows]


def test_replay_and_its_replies_print_escapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    event = {"source": {"platform": "telegram", "chat_id": "7", "user_id": "7"}, "text": HOSTILE}
    events.write_text(json.dumps(event) + "\n", encoding="utf-8")
    assert main(["replay", str(events), "--state-dir", str(tmp_path / "replayed")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    _inert(out)
    assert r"line 1: 7> zebra \x1b]0;pwned\x07 title" in out  # the event, on its line
    assert r"→ telegram:7: echo: zebra \x1b]0;pwned\x07 title" in out  # the gateway's reply
