"""SQLite's full-text index behind a watermark: indexed in bulk, searched exactly.

A message insert does not touch the index; once enough messages wait, the writer indexes them
in one transaction and moves ``state_meta.fts_indexed_through``. Search merges the index's hits
with those of the messages past the watermark, matched by a private FTS5 table of the same
tokenizer, so what a search finds never depends on whether a message is indexed yet.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects import sqlite_fts
from hermes_plugins.sql_store.schema import SCHEMA_VERSION

EVERY = 5


@pytest.fixture(autouse=True)
def _small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_fts, "INDEX_EVERY", EVERY)


def _open(home: Path, *, read_only: bool = False) -> SessionStore:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home), read_only=read_only)


def _raw(home: Path, statement: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(home / "state.db") as conn:
        return conn.execute(statement).fetchall()


def _watermark(home: Path) -> int:
    rows = _raw(home, "SELECT value FROM state_meta WHERE key = 'fts_indexed_through'")
    return int(str(rows[0][0]))


def _indexed(home: Path) -> int:
    return int(str(_raw(home, "SELECT count(*) FROM messages_fts_docsize")[0][0]))


def test_messages_are_indexed_in_bulk_and_found_before_and_after(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = _open(home)
    entry = store.get_or_create_session(telegram_dm())
    for number in range(EVERY - 1):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": f"kiwi {number}"})
    assert (_watermark(home), _indexed(home)) == (0, 0)  # nothing indexed yet
    assert len(store.search("kiwi")) == EVERY - 1  # found past the watermark
    for number in range(EVERY - 1, 2 * EVERY + 2):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": f"kiwi {number}"})
    assert _watermark(home) == _indexed(home) == 2 * EVERY  # two bulk passes, two waiting
    hits = store.search("kiwi", limit=100)
    assert sorted(hit.snippet for hit in hits) == sorted(f"kiwi {n}" for n in range(2 * EVERY + 2))
    assert store.health()["fts"] == "ok"
    store.close()


def test_the_tail_matches_words_as_the_index_does(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = _open(home)
    entry = store.get_or_create_session(telegram_dm())
    texts = ["the alphabet song", "Alpha and omega", "ALPHA-numeric", "tool said alpha"]
    for text in texts:  # indexed (EVERY - 1 more follow)
        store.append_to_transcript(entry.session_id, {"role": "user", "content": text})
    for _ in range(EVERY):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "filler"})
    indexed = sorted(hit.snippet for hit in store.search("alpha"))
    assert _watermark(home) >= len(texts)
    for text in texts:  # the same texts again, now past the watermark
        store.append_to_transcript(entry.session_id, {"role": "assistant", "content": text})
    assert _watermark(home) < len(texts) + EVERY + len(texts)
    both = sorted(hit.snippet for hit in store.search("alpha", limit=100))
    assert indexed == [
        "ALPHA-numeric",
        "Alpha and omega",
        "tool said alpha",
    ]  # words, not "alphabet"
    assert both == sorted(indexed * 2)
    store.close()


def test_a_watermark_read_before_a_bulk_pass_never_loses_or_doubles_hits(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = _open(home)
    entry = store.get_or_create_session(telegram_dm())
    for number in range(2 * EVERY + 1):
        store.append_to_transcript(entry.session_id, {"role": "user", "content": f"fig {number}"})
    assert _watermark(home) == 2 * EVERY
    # As a search sees it when a bulk pass commits between its reading of the watermark and of
    # the index: rows in both, to be merged.
    _raw(home, f"UPDATE state_meta SET value = '{EVERY}' WHERE key = 'fts_indexed_through'")
    snippets = [hit.snippet for hit in store.search("fig", limit=100)]
    assert sorted(snippets) == sorted(f"fig {n}" for n in range(2 * EVERY + 1))
    store.close()


def test_a_read_only_store_finds_the_newest_messages_beside_the_writer(tmp_path: Path) -> None:
    home = tmp_path / "home"
    writer = _open(home)
    entry = writer.get_or_create_session(telegram_dm())
    for number in range(EVERY + 2):
        writer.append_to_transcript(entry.session_id, {"role": "user", "content": f"lime {number}"})
    reader = _open(home, read_only=True)
    assert len(reader.search("lime", limit=100)) == EVERY + 2
    reader.close()
    writer.close()


def test_a_version_3_database_keeps_what_its_index_holds(tmp_path: Path) -> None:
    """Upgrading: every message the old insert trigger indexed is at or below the watermark."""
    home = tmp_path / "home"
    store = _open(home)
    entry = store.get_or_create_session(telegram_dm())
    store.close()
    old_insert = (
        "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN INSERT INTO "
        "messages_fts(rowid, content, tool_name, tool_calls) VALUES (new.id, new.content, "
        "new.tool_name, new.tool_calls); END"
    )
    for statement in (
        "DROP TRIGGER messages_fts_delete", "DROP TRIGGER messages_fts_update", old_insert,
        "DELETE FROM state_meta WHERE key = 'fts_indexed_through'",
        "UPDATE schema_version SET version = 3",
        f"INSERT INTO messages (session_id, role, content, timestamp) VALUES "
        f"('{entry.session_id}', 'user', 'plum from version three', 1.0)",
    ):  # fmt: skip
        _raw(home, statement)
    upgraded = _open(home)
    assert _raw(home, "SELECT version FROM schema_version")[0][0] == SCHEMA_VERSION
    assert _watermark(home) == 1
    triggers = {
        name for (name,) in _raw(home, "SELECT name FROM sqlite_master WHERE type='trigger'")
    }
    assert "messages_fts_insert" not in triggers
    upgraded.append_to_transcript(entry.session_id, {"role": "user", "content": "plum today"})
    assert sorted(hit.snippet for hit in upgraded.search("plum")) == [
        "plum from version three", "plum today",
    ]  # fmt: skip
    upgraded.close()
