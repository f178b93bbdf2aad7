"""``export --output FILE`` writes beside the file and renames it into place once complete: a
real export killed midway leaves no file, or the previous one intact, and running it again
writes the whole export. Its progress bar is drawn on a terminal only, and not per item."""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from support.killing import killed_when
from support.populate import populate, run
from support.terminal import Terminal

from hermes_core.cli.common import Progress, open_operator
from hermes_core.cli.exporting import EXPORT_PAGE, export_jsonl
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import StoreUnavailableError

MESSAGES = 60_000
"""Enough for an export to take a while (many pages) after it wrote its first."""


def _add_messages(home: Path, session_key: str) -> None:
    with closing(sqlite3.connect(home / "state.db")) as conn, conn:
        (session_id,) = conn.execute(
            "SELECT session_id FROM gateway_routing WHERE session_key = ?", (session_key,)
        ).fetchone()
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "SELECT ?, 'user', 'message ' || i || ' of a long transcript, zebra café', "
            "1790000000 + i FROM n",
            (MESSAGES, session_id),
        )


def _killed_midway(home: Path, target: Path) -> int:
    """Start an export into ``target``, kill it (SIGKILL) once it has written part of its
    output; the size of that part."""
    partial = target.with_name(f".{target.name}.partial")
    killed_when(
        ["export", "--state-dir", str(home), "-o", str(target)],
        lambda _: partial.exists() and partial.stat().st_size > 0,
    )
    return partial.stat().st_size


@pytest.mark.slow
def test_an_export_killed_midway_leaves_the_file_as_it_was_and_a_rerun_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    keys = populate(home)
    _add_messages(home, keys["alice"])
    code, expected, _ = run(capsys, "export", "--state-dir", str(home))
    assert code == 0
    assert expected.count("\n") > MESSAGES
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "export.jsonl"
    assert _killed_midway(home, target) < len(expected.encode())
    assert not target.exists()  # no truncated file that looks complete
    target.write_text("the previous export\n", encoding="utf-8")
    assert _killed_midway(home, target) < len(expected.encode())
    assert target.read_text(encoding="utf-8") == "the previous export\n"
    code, _, _ = run(capsys, "export", "--state-dir", str(home), "-o", str(target))
    assert code == 0
    assert target.read_text(encoding="utf-8") == expected
    assert [path.name for path in target.parent.iterdir()] == ["export.jsonl"]


def test_an_export_that_fails_leaves_the_file_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "state"
    populate(home)
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "export.jsonl"
    target.write_text("the previous export\n", encoding="utf-8")

    def fail(*_: object, **__: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hermes_core.cli.exporting.export_jsonl", fail)
    code, out, err = run(capsys, "export", "--state-dir", str(home), "-o", str(target))
    assert (code, out) == (2, "")
    assert "No space left on device" in err
    assert "left as it was" in err
    assert target.read_text(encoding="utf-8") == "the previous export\n"
    assert [path.name for path in target.parent.iterdir()] == ["export.jsonl"]


def test_progress_is_drawn_on_a_terminal_only_and_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    terminal = Terminal()
    bar = Progress("export", 1000, terminal)
    for _ in range(1000):  # a millisecond per item: a second in all
        bar.advance()
        clock[0] += 0.001
    bar.close()
    drawn = terminal.getvalue()
    assert 10 <= drawn.count("\r") <= 12  # every 0.1 s, and once more as it ends
    assert drawn.endswith("\rexport [##############################] 1,000/1,000\n")
    piped = io.StringIO()
    bar = Progress("export", 3, piped)
    bar.advance(3)
    bar.close()
    assert piped.getvalue() == ""


@pytest.mark.parametrize("ahead", [False, True], ids=["sqlite-default", "read-ahead"])
def test_pages_keep_their_order_and_a_failed_read_stops_the_export(
    tmp_path: Path, ahead: bool
) -> None:
    """``export`` reads its pages one after another on SQLite (``reads_ahead`` False: a reading
    thread beside the writing one slows both there), or the next on a thread while it writes
    this one (a server's backend; forced here): either way the lines come in primary-key
    order, and a read that fails ends the export with that read's error after the pages before
    it, never with a page skipped."""
    home = tmp_path / "state"
    keys = populate(home)
    _add_messages(home, keys["alice"])
    config = GatewayConfig(hermes_home=home)
    backend = open_operator(config, write=False)
    assert backend.reads_ahead is False
    backend.reads_ahead = ahead
    try:
        readers: set[str] = set()
        reads = 0
        table_rows = backend.table_rows

        def failing(name: str, after: Any, limit: int, upto: Any = None) -> list[dict[str, Any]]:
            nonlocal reads
            readers.add(threading.current_thread().name)
            if name == "messages" and fail:
                reads += 1
                if reads == 4:
                    raise StoreUnavailableError("the database went away")
            return table_rows(name, after, limit, upto)

        backend.table_rows = failing  # type: ignore[method-assign]
        fail = False
        whole = io.StringIO()
        export_jsonl(backend, whole)
        ids = [
            json.loads(line)["row"]["id"]
            for line in whole.getvalue().splitlines()
            if line.startswith('{"table": "messages"')
        ]
        assert len(ids) > 10 * EXPORT_PAGE
        assert ids == sorted(ids)
        on_threads = {name.startswith("export-read") for name in readers}
        assert on_threads == {ahead}
        fail = True
        cut = io.StringIO()
        with pytest.raises(StoreUnavailableError, match="went away"):
            export_jsonl(backend, cut)
        lines = cut.getvalue().splitlines()
        assert sum(line.startswith('{"table": "messages"') for line in lines) == 3 * EXPORT_PAGE
        assert whole.getvalue().startswith(cut.getvalue())
    finally:
        backend.close()
