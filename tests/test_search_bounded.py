"""Search ranks a bounded candidate set: the newest ``rank_among`` matches that its scope keeps
(active messages, of a session or a key's sessions), on SQLite (indexed or past the watermark)
and on PostgreSQL. ``rank_among`` is set to 4 here, so a term with more matches is ranked among
its 4 newest, and a scope or a deactivation never hides a match that it keeps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text

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


# -- PostgreSQL's windows: the same hits as ranking the newest matches directly ----------------

FILLER = "banana and bread"
RANKED = ["kiwi", "kiwi kiwi", "kiwi kiwi kiwi", "a kiwi among many other words here"]


@pytest.fixture(params=[(3, 1), (3, 5), (2_000, 100)], ids=["windows", "sampled", "one-probe"])
def pg_store(
    request: pytest.FixtureRequest, empty_database: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SessionStore]:  # fmt: skip
    """A PostgreSQL store ranking among the 4 newest matches, whose search walks the newest
    ``probe`` ids first and samples windows of ``sample_ids`` ids: small ones, so that the
    crafted stores below take several windows or the GIN read, or one probe covering all."""
    probe, sample_ids = request.param
    monkeypatch.setattr(SearchIndex, "rank_among", AMONG)
    monkeypatch.setattr(postgresql_search, "PROBE_ROWS", probe)
    monkeypatch.setattr(postgresql_search, "SAMPLE_IDS", sample_ids)
    home = tmp_path / "home"
    config = GatewayConfig.from_dict(
        {"storage": {"url": empty_database}}, environ={"HERMES_HOME": str(home)}
    )
    opened = SessionStore.open(config, plugins=fresh_plugin_manager(home))
    yield opened
    opened.close()


def _append(store: SessionStore, session_id: str, contents: list[str]) -> list[int]:
    for content in contents:
        store.append_to_transcript(session_id, {"role": "user", "content": content})
    return [int(message["id"]) for message in store.load_transcript(session_id)[-len(contents) :]]


def _expected(
    query: str, limit: int, session_id: str | None = None, session_key: str | None = None
) -> list[int]:
    """The best ``limit`` by ``ts_rank`` (ties newest first) of the newest ``AMONG`` active
    matches in scope, in one statement over the whole table."""
    scope = " AND m.session_id = :session_id" if session_id else ""
    if session_key:
        scope += " AND m.session_id IN (SELECT id FROM sessions WHERE session_key = :key)"
    statement = text(
        "SELECT id FROM (SELECT m.id, ts_rank(m.search_tsv, q) AS rank FROM messages m, "
        "plainto_tsquery('simple', :query) q WHERE m.active = 1 AND m.search_tsv @@ q"
        f"{scope} ORDER BY m.id DESC LIMIT :among) newest ORDER BY rank DESC, id DESC "
        "LIMIT :limit"
    )
    engine = create_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                statement,
                {"query": query, "among": AMONG, "limit": limit, "session_id": session_id,
                 "key": session_key},
            )  # fmt: skip
            return [int(row.id) for row in found]
    finally:
        engine.dispose()


def _agrees(store: SessionStore, queries: list[str], **scope: str) -> None:
    for query in queries:
        for limit in (1, 2, 3, 100):
            hits = store.search(query, limit=limit, **scope)
            assert _ids(hits) == _expected(query, limit, **scope), (query, limit, scope)


def test_a_common_word_past_newer_messages_without_it(pg_store: SessionStore) -> None:
    old_entry = pg_store.get_or_create_session(telegram_dm("1"))
    new = pg_store.get_or_create_session(telegram_dm("2")).session_id
    older = _append(pg_store, old_entry.session_id, [RANKED[n % 4] for n in range(12)])
    _append(pg_store, new, ["kiwi kiwi", FILLER, "kiwi"] * 2)
    _append(pg_store, new, [FILLER] * 25)  # the newest 25 lack the word
    # the newest matches deactivated: soft-deleted, and a transcript rewritten without them
    assert pg_store.soft_delete_messages(old_entry.session_id, older[-2:]) == 2
    pg_store.rewrite_transcript(new, [{"role": "user", "content": FILLER}])
    hits = pg_store.search("kiwi", limit=100)
    assert set(_ids(hits)) == set(older[-6:-2])
    _agrees(pg_store, ["kiwi", "kiwi kiwi", "bread kiwi", "absent"])
    _agrees(pg_store, ["kiwi"], session_key=old_entry.session_key)
    _agrees(pg_store, ["kiwi", "banana"], session_id=new)


def test_a_rare_word_only_in_the_oldest_messages(pg_store: SessionStore) -> None:
    entry = pg_store.get_or_create_session(telegram_dm("1"))
    other = pg_store.get_or_create_session(telegram_dm("2")).session_id
    rare = _append(pg_store, entry.session_id, ["quokka kiwi", "kiwi quokka quokka"])
    _append(pg_store, other, [FILLER, "kiwi"] * 15)
    assert _ids(pg_store.search("quokka")) == [rare[1], rare[0]]
    _agrees(pg_store, ["quokka", "quokka kiwi", "kiwi"])
    _agrees(pg_store, ["quokka", "kiwi"], session_key=entry.session_key)


def _searched(store: SessionStore, query: str, seen: Callable[[Any], object]) -> list[object]:
    """What ``seen`` gives of each connection after each statement of a search that reads the
    messages, with the search's hits."""
    statements: list[object] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM messages" in statement:
            statements.append(seen(conn))

    event.listen(Engine, "after_cursor_execute", record)
    try:
        assert len(store.search(query)) == 1
    finally:
        event.remove(Engine, "after_cursor_execute", record)
    return statements


def test_a_rare_word_takes_three_statements(pg_store: SessionStore) -> None:
    session_id = pg_store.get_or_create_session(telegram_dm("1")).session_id
    _append(pg_store, session_id, ["quokka"] + [FILLER] * 30)
    statements = _searched(pg_store, "quokka", lambda conn: None)
    # the newest id, the sample with the newest ids walked, then the GIN index (or, when one
    # probe covers all, nothing more)
    assert len(statements) == (2 if postgresql_search.PROBE_ROWS > 31 else 3)


def test_a_search_runs_without_jit(pg_store: SessionStore) -> None:
    """JIT compilation (0.6 s when the planner misjudges a read's rows) is off for the search's
    statements after the first."""
    session_id = pg_store.get_or_create_session(telegram_dm("1")).session_id
    _append(pg_store, session_id, ["quokka"] + [FILLER] * 30)
    settings = _searched(pg_store, "quokka", lambda conn: conn.exec_driver_sql("SHOW jit").scalar())
    assert len(settings) >= 2
    assert set(settings) == {"off"}


def test_windows_grow_while_walking_is_cheaper_than_reading_older_matches() -> None:
    assert postgresql_search.next_window(0, 4, 10, 50.0) == 10  # none seen: double
    assert postgresql_search.next_window(0, 4, 10, 10.0) is None  # as dear as the index
    assert postgresql_search.next_window(2, 4, 10, 500.0) == 20  # 4 more at 1 in 5
    assert postgresql_search.next_window(8, 4, 100, 500.0) == 100  # at least as many as walked
    assert postgresql_search.next_window(2, 4, 10, 19.0) is None  # 20 rows against 19 matches
