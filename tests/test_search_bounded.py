"""Search ranks a bounded candidate set: the newest ``rank_among`` matches that its scope keeps
(active messages, of a session or a key's sessions), on SQLite (indexed or past the watermark)
and on PostgreSQL. ``rank_among`` is set to 4 here, so a term with more matches is ranked among
its 4 newest, and a scope or a deactivation never hides a match that it keeps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects import postgresql_search
from hermes_plugins.sql_store.search import SearchIndex

AMONG = 4
WEAK = "kiwi and a few other words around it"
STRONG = "kiwi kiwi"
BEST = "kiwi kiwi kiwi"


@pytest.fixture(params=["sqlite-indexed", "sqlite-tail", "postgresql", "postgresql-probe3"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend; on SQLite whether the messages are indexed or wait past the watermark
    (fewer than 256 messages do); on PostgreSQL whether the probe of the newest messages
    covers them all or only 3, so that the search walks on or reads the GIN index after it."""
    if request.param.startswith("postgresql"):
        request.getfixturevalue("empty_database")
    if request.param == "postgresql-probe3":
        monkeypatch.setattr(postgresql_search, "PROBE_ROWS", 3)
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SessionStore]:
    """A store whose searches rank among the 4 newest matches."""
    monkeypatch.setattr(SearchIndex, "rank_among", AMONG)
    settings = {"storage": {"url": POSTGRES_URL}} if kind.startswith("postgresql") else {}
    home = tmp_path / "home"
    config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})
    opened = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    yield opened
    opened.close()


@pytest.fixture
def settle(kind: str, store: SessionStore) -> Callable[[], None]:
    """After the writes: on ``sqlite-indexed``, index every message."""

    def settle_() -> None:
        if kind == "sqlite-indexed":
            assert store.rebuild_search_index()

    return settle_


def _write(store: SessionStore, session_id: str, contents: list[str]) -> list[int]:
    """Each content, followed by two messages without the term (so that it stays rarer than
    half the messages, as FTS5's ranking of an in-memory tail needs); the contents' ids."""
    ids = []
    for content in contents:
        store.append_to_transcript(session_id, {"role": "user", "content": content})
        ids.append(int(store.load_transcript(session_id)[-1]["id"]))
        for _ in range(2):
            store.append_to_transcript(session_id, {"role": "assistant", "content": "banana"})
    return ids


def _ids(hits: list[Any]) -> list[int]:
    return [hit.message_id for hit in hits]


def test_a_common_term_is_ranked_among_its_newest_matches(
    store: SessionStore, settle: Callable[[], None]
) -> None:
    old = store.get_or_create_session(telegram_dm("1")).session_id
    new = store.get_or_create_session(telegram_dm("2")).session_id
    _write(store, old, [BEST] * 3)  # the best matches, but older than 4 others
    weak = _write(store, new, [WEAK] * 5)
    strong = _write(store, new, [STRONG])
    last = _write(store, new, [WEAK])
    settle()
    newest = {*weak[-2:], *strong, *last}
    hits = store.search("kiwi")
    assert set(_ids(hits)) == newest
    assert _ids(hits)[0] == strong[0]  # the best of the newest 4 first
    assert _ids(store.search("kiwi", limit=1)) == strong
    assert set(_ids(store.search("kiwi", limit=100))) == newest


def test_a_scope_ranks_among_its_own_newest_matches(
    store: SessionStore, settle: Callable[[], None]
) -> None:
    old_entry = store.get_or_create_session(telegram_dm("1"))
    new = store.get_or_create_session(telegram_dm("2")).session_id
    old = _write(store, old_entry.session_id, [BEST, WEAK, STRONG])
    newer = _write(store, new, [WEAK] * 6)
    settle()
    assert not set(old) & set(_ids(store.search("kiwi")))
    # the old session's matches are all kept by its scope, though none is among the 4 newest
    by_session = store.search("kiwi", session_id=old_entry.session_id)
    assert _ids(by_session) == [old[0], old[2], old[1]]  # best first
    by_key = store.search("kiwi", session_key=old_entry.session_key)
    assert _ids(by_key) == _ids(by_session)
    # a scope with more matches than 4 ranks its 4 newest
    assert set(_ids(store.search("kiwi", session_id=new, limit=100))) == set(newer[-AMONG:])


def test_deactivated_matches_leave_room_for_older_active_ones(
    store: SessionStore, settle: Callable[[], None]
) -> None:
    session_id = store.get_or_create_session(telegram_dm("1")).session_id
    ids = _write(store, session_id, [WEAK] * 9)
    settle()
    assert store.soft_delete_messages(session_id, ids[-AMONG:]) == AMONG
    expected = set(ids[-2 * AMONG : -AMONG])
    assert set(_ids(store.search("kiwi", limit=100))) == expected
    assert set(_ids(store.search("kiwi", session_id=session_id, limit=100))) == expected
