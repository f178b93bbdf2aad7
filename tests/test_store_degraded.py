"""Degraded mode: the store keeps working on JSONL when SQLite cannot be used, then replays the
backlog into SQL exactly once; a broken full-text index never loses a message."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hermes_core import GatewayConfig
from hermes_core.domain.errors import StoreError
from hermes_core.store import SessionStore
from hermes_core.store.backing import DEGRADED_WARNING
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.testing.store_contract import StoreContract, StoreFactory
from hermes_plugins.sql_store.dialects import sqlite_fts


def blocked_store(home: Path) -> SessionStore:
    """A store whose SQLite directory cannot be created: ``<home>/db`` is a regular file."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    blocker = home / "db"
    if not blocker.exists():
        blocker.write_text("not a directory")
    url = f"sqlite:///{home}/db/state.db"
    config = GatewayConfig.from_dict({"storage": {"url": url}}, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


def sqlite_store(home: Path, url: str | None = None) -> SessionStore:
    settings = {"storage": {"url": url}} if url else {}
    config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


class TestDegradedJsonlStore(StoreContract):
    """The contract holds on the JSONL fallback too."""

    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        return blocked_store


def test_fallback_warns_once_and_reports_health(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        store = blocked_store(tmp_path / "home")
    warnings = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(DEGRADED_WARNING)
    ]
    assert len(warnings) == 1
    health = store.health()
    assert health["degraded"] is True
    assert health["backend"] == "jsonl"
    assert health["queue_persistent"] is False
    assert health["ledger"] == "unavailable"
    assert health["degraded_reason"]
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "still stored"})
    assert store.search("stored") == []
    assert store.prune_old_entries(1) == 0
    caplog.clear()
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "again"})
    assert not caplog.records  # no per-message warnings
    store.close()


def test_backlog_replays_into_sql_exactly_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    degraded = blocked_store(home)
    entry = degraded.get_or_create_session(telegram_dm(chat_name="Lab"))
    for content in ("first", "second"):
        degraded.append_to_transcript(entry.session_id, {"role": "user", "content": content})
    degraded.close()

    (home / "db").unlink()  # the operator fixes the directory
    store = sqlite_store(home, f"sqlite:///{home}/db/state.db")
    assert not store.degraded
    report = store._fallback.replay_backlog()
    assert report is not None
    assert (report.files_replayed, report.messages_imported) == (1, 2)
    assert store.peek_session_id(entry.session_key) == entry.session_id
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["first", "second"]
    assert [hit.session_id for hit in store.search("second")] == [entry.session_id]
    again = store._fallback.replay_backlog()
    assert again is not None
    assert again.messages_imported == 0
    assert len(store.load_transcript(entry.session_id)) == 2
    assert (store.sessions_dir / f"{entry.session_id}.jsonl.imported").exists()
    store.close()


def test_housekeeping_leaves_degraded_mode_when_sql_returns(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = blocked_store(home)
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "kept"})
    assert not store._fallback.try_leave_degraded()  # still blocked
    (home / "db").unlink()
    assert store._fallback.try_leave_degraded()
    assert not store.degraded
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["kept"]
    store.append_to_transcript(entry.session_id, {"role": "assistant", "content": "in sql"})
    assert [hit.session_id for hit in store.search("sql")] == [entry.session_id]
    store.close()


def test_corrupt_database_file_falls_back_and_is_left_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = sqlite_store(home)
    store.get_or_create_session(telegram_dm())
    store.close()
    database = home / "state.db"
    garbage = b"this is not a database " * 200
    database.write_bytes(garbage)
    reopened = sqlite_store(home)
    assert reopened.degraded
    assert "not a database" in reopened.health()["degraded_reason"]
    # Routing comes from the mirror written at close, so the lane keeps its session.
    assert reopened.lookup_by_session_key("agent:main:telegram:dm:c=99") is not None
    reopened.close()
    assert database.read_bytes() == garbage


def test_corruption_detected_mid_operation_switches_to_jsonl(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    store = sqlite_store(home)
    entry = store.get_or_create_session(telegram_dm())
    raw = sqlite3.connect(home / "state.db")
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page now lives in the main file
    raw.close()
    with (home / "state.db").open("r+b") as handle:  # a broken disk rewrites the header
        handle.write(b"\x00" * 100)
    # The write that meets the corruption is run again on the JSONL fallback: nothing is lost.
    second = store.get_or_create_session(telegram_dm("2"))
    assert store.degraded
    assert store.lookup_by_session_key(second.session_key) is not None
    assert any(
        "state.db" in r.getMessage() and "hermes-sessions doctor" in r.getMessage()
        for r in caplog.records
    )
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "after"})
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["after"]
    assert store.lookup_by_session_key(entry.session_key) is not None
    store.close()


def test_broken_fts_index_fails_open_and_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fts, "INDEX_EVERY", 1)  # each commit indexes its messages
    home = tmp_path / "home"
    store = sqlite_store(home)
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "before breakage"})
    raw = sqlite3.connect(home / "state.db")
    raw.execute("DROP TABLE messages_fts_data")  # the index loses its storage
    raw.commit()
    raw.close()
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "during breakage"})
    assert store.health()["fts"] == "stale"
    contents = [m["content"] for m in store.load_transcript(entry.session_id)]
    assert contents == ["before breakage", "during breakage"]
    assert [hit.snippet for hit in store.search("during")] == ["during breakage"]  # scan
    assert store.rebuild_search_index()
    assert store.health()["fts"] == "ok"
    assert len(store.search("breakage")) == 2
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "after repair"})
    assert len(store.search("repair")) == 1
    store.close()
    assert sqlite_store(home).health()["fts"] == "ok"


def test_garbled_fts_blocks_are_scanned_around_and_fail_open_on_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fts, "INDEX_EVERY", 1)  # each commit indexes its messages
    home = tmp_path / "home"
    store = sqlite_store(home)
    entry = store.get_or_create_session(telegram_dm())
    for i in range(30):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": f"alpha {i}"})
    raw = sqlite3.connect(home / "state.db")
    garbage = "x'" + "ff" * 16 + "'"  # always undecodable (random bytes only almost always)
    raw.execute(f"UPDATE messages_fts_data SET block = {garbage} WHERE id > 1")
    raw.commit()
    raw.close()
    hits = store.search("alpha")
    assert len(hits) == 20  # answered by the scan, not lost
    assert store.health()["fts"] == "ok"  # a search never disables the index
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "alpha 30"})
    assert store.health()["fts"] == "stale"  # the write told the index's fault from its own
    assert len(store.load_transcript(entry.session_id)) == 31
    assert store.rebuild_search_index()
    assert len(store.search("alpha", limit=100)) == 31
    store.close()


def test_a_failing_step_never_repeats_another_steps_writes_while_degraded(
    tmp_path: Path,
) -> None:
    store = blocked_store(tmp_path / "home")
    entry = store.get_or_create_session(telegram_dm())
    release = threading.Event()
    results: list[object] = []

    def slow_first() -> None:  # holds the writer so that the next two steps wait together
        release.wait(5)

    def append(content: str) -> None:
        store.append_to_transcript(entry.session_id, {"role": "user", "content": content})

    def broken() -> None:
        raise StoreError("this step fails")

    def run(step: Callable[[], object]) -> None:
        try:
            results.append(store.run(step))
        except StoreError as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(step,)) for step in
               (slow_first, lambda: append("once"), broken)]  # fmt: skip
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(5)
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["once"]
    assert any(isinstance(result, StoreError) for result in results)
    store.close()
