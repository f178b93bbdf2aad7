"""``export --jobs N`` spreads the large tables over worker processes, each reading and encoding
spans of keys: the output is byte for byte the export of one process, on both backends; a
worker that dies ends the export with a named error; and workers never outlive an export that
was killed."""

from __future__ import annotations

import io
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import create_engine
from support.killing import killed_when
from support.populate import config_for, populate, where

from hermes_core.cli import exporting
from hermes_core.cli.common import open_operator
from hermes_core.domain.errors import StoreUnavailableError


def _add_messages(home: Path, url: str | None, count: int) -> int:
    """``count`` more messages on the first session, in one statement; how many are stored."""
    engine = create_engine(url or f"sqlite:///{home / 'state.db'}")
    with engine.begin() as conn:
        (session_id,) = conn.exec_driver_sql("SELECT min(id) FROM sessions").one()
        conn.exec_driver_sql(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < %(count)s) "
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "SELECT %(session)s, 'user', 'message ' || i || ', café \u202e ünïcode', "
            "1790000000.25 + i FROM n"
            if url
            else "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "SELECT ?, 'user', 'message ' || i || ', café \u202e ünïcode', "
            "1790000000.25 + i FROM n",
            {"count": count, "session": session_id} if url else (count, session_id),
        )
        stored = int(conn.exec_driver_sql("SELECT count(*) FROM messages").scalar_one())
    engine.dispose()
    return stored


def _workers(process: psutil.Process) -> list[psutil.Process]:
    """The export's worker processes among ``process``'s children (not multiprocessing's
    resource tracker)."""
    found = []
    for child in process.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _export(home: Path, url: str | None, jobs: int) -> tuple[str, int]:
    config = config_for(home, url)
    backend = open_operator(config, write=False)
    try:
        out = io.StringIO()
        lines = exporting.export_jsonl(backend, out, config=config, jobs=jobs)
    finally:
        backend.close()
    return out.getvalue(), lines


def test_workers_write_the_bytes_one_process_writes(
    tmp_path: Path, url: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans of 1,000 messages over two workers: the same bytes and line count as one process,
    every message once and in id order, and the workers were used."""
    home = tmp_path / "state"
    populate(home, url)
    stored = _add_messages(home, url, 9_500)
    monkeypatch.setattr(exporting, "EXPORT_SPAN", 1_000)  # the spans are cut in this process
    spread: list[str] = []
    lines = exporting._Workers.lines

    def counted(self: Any, backend: Any, name: str) -> Iterator[tuple[str, int]]:
        spread.append(name)
        return lines(self, backend, name)

    monkeypatch.setattr(exporting._Workers, "lines", counted)
    alone, alone_count = _export(home, url, jobs=1)
    assert spread == []
    together, together_count = _export(home, url, jobs=2)
    assert spread == ["messages"]
    assert together == alone
    assert together_count == alone_count == len(alone.splitlines())
    ids = [line for line in alone.splitlines() if line.startswith('{"table": "messages"')]
    assert len(ids) == stored
    assert "\\u202e" in alone  # the bidi override made inert
    assert "\u202e" not in alone


def test_a_worker_that_dies_ends_the_export_with_a_named_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed (SIGKILL) while the export runs: the export stops with
    StoreUnavailableError saying what happened and how to run it again."""
    home = tmp_path / "state"
    populate(home)
    _add_messages(home, None, 20_000)
    monkeypatch.setattr(exporting, "EXPORT_SPAN", 500)
    lines = exporting._Workers.lines

    def killing(self: Any, backend: Any, name: str) -> Iterator[tuple[str, int]]:
        for index, part in enumerate(lines(self, backend, name)):
            if index == 1:
                os.kill(_workers(psutil.Process())[0].pid, signal.SIGKILL)
            yield part

    monkeypatch.setattr(exporting._Workers, "lines", killing)
    with pytest.raises(StoreUnavailableError, match=r"worker process ended.*--jobs 1"):
        _export(home, None, jobs=2)


def test_workers_end_with_an_export_that_was_killed(tmp_path: Path) -> None:
    """``hermes-sessions export --jobs 2`` killed (SIGKILL) once its workers run: they exit
    on their own, and no output file is put in place."""
    home = tmp_path / "state"
    populate(home)
    _add_messages(home, None, 4 * exporting.EXPORT_SPAN)
    target = tmp_path / "export.jsonl"
    workers: list[psutil.Process] = []

    def started(child: subprocess.Popen[bytes]) -> bool:
        workers[:] = _workers(psutil.Process(child.pid))
        return len(workers) >= 2

    killed_when(["export", *where(home, None), "--jobs", "2", "-o", str(target)], started)
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert alive == [], f"workers outlived the export: {alive}"
    assert len(gone) == len(workers)
    assert not target.exists()
