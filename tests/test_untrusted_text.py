"""Untrusted text through the store: lone surrogates, NUL and hostile search queries.

Every text field of a source, an event and a message is normalised once (NUL removed, lone
surrogates as U+FFFD), identically on SQLite and PostgreSQL, so what is read back is what was
normalised, and only ``HermesError`` ever escapes. Search takes any string as data and never
changes the index's health.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig, MessageEvent, SessionSource
from hermes_core.domain.errors import HermesError, InvalidValueError, TranscriptWriteError
from hermes_core.domain.text import MAX_NESTING, clean_text
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter, TurnRequest
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.sql_store.dialects import sqlite_fts

_chats = itertools.count()
# Any code point, surrogates and NUL included (hypothesis leaves surrogates out by default).
_hostile = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=24)


def _open(home: Path, url: str | None = None) -> SessionStore:
    settings_ = {"storage": {"url": url}} if url else {}
    config = GatewayConfig.from_dict(settings_, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request: pytest.FixtureRequest) -> str | None:
    if request.param == "sqlite":
        return None
    if not POSTGRES_URL:
        pytest.skip(POSTGRES_SKIP_REASON)
    return str(request.getfixturevalue("empty_database"))


@pytest.fixture
def store(tmp_path: Path, backend_url: str | None) -> Iterator[SessionStore]:
    opened = _open(tmp_path / "home", backend_url)
    yield opened
    opened.close()


# -- the normal form ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("hi \ud83d", "hi \ufffd"),  # the first half of an emoji
        ("\ude00 tail", "\ufffd tail"),  # the second half
        ("\ud83d\ude00", "\U0001f600"),  # both halves as two code points: joined
        ("a\x00b\x00", "ab"),
        ("plain ascii", "plain ascii"),
        ("ünïcödé \U0001f600", "ünïcödé \U0001f600"),
    ],
)
def test_clean_text(raw: str, clean: str) -> None:
    assert clean_text(raw) == clean
    clean.encode("utf-8")  # always encodable


def test_models_hold_the_normal_form() -> None:
    source = SessionSource(
        platform="telegram", chat_id="-100", chat_type="group", chat_name="caf\ud83d\x00",
        user_name="\x00bob", chat_topic="t\udfff",
    )  # fmt: skip
    assert (source.chat_id, source.chat_name, source.user_name, source.chat_topic) == (
        "-100", "caf\ufffd", "bob", "t\ufffd",
    )  # fmt: skip
    event = MessageEvent(
        source=source, text="x\ud83d", message_id="m\x00", media_urls=("u\ud800",),
        metadata={"k\ud800": ["v\x00"]},
    )  # fmt: skip
    assert event.text == "x\ufffd"
    assert event.message_id == "m"
    assert event.media_urls == ("u\ufffd",)
    assert event.metadata == {"k\ufffd": ["v"]}
    restored = MessageEvent.from_dict(event.to_dict())
    assert restored.to_dict() == event.to_dict()


def test_deeply_nested_metadata_is_a_named_error() -> None:
    nested: object = "leaf"
    for _ in range(MAX_NESTING + 5):
        nested = [nested]
    with pytest.raises(InvalidValueError, match="levels deep"):
        MessageEvent(source=telegram_dm(), metadata={"deep": nested})


# -- through the store, on both backends -----------------------------------------------------------


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    chat_name=_hostile, user_name=_hostile, topic=_hostile, chat_id=_hostile,
    content=_hostile, tool_name=_hostile, extra=_hostile, query=_hostile,
)  # fmt: skip
def test_any_text_is_stored_as_its_normal_form(
    store: SessionStore, chat_name: str, user_name: str, topic: str, chat_id: str,
    content: str, tool_name: str, extra: str, query: str,
) -> None:  # fmt: skip
    health = store.health()
    chat_id = f"{next(_chats)}{chat_id}"  # a new lane per example: its origin is this source
    try:
        source = SessionSource(
            platform="telegram", chat_id=chat_id, chat_type="group", chat_name=chat_name,
            user_name=user_name, chat_topic=topic, user_id="7",
        )  # fmt: skip
        entry = store.get_or_create_session(source)
        message = {"role": "user", "content": content, "tool_name": tool_name, "note": extra}
        store.append_to_transcript(entry.session_id, message)
        stored = store.load_transcript(entry.session_id)[-1]
        hits = store.search(query)
        store.search(content)
        store.lookup_by_session_id(chat_name)
        store.lookup_by_session_key(chat_name)
        store.set_session_metadata(entry.session_key, extra, {topic: [content]})
        again = store.lookup_by_session_key(entry.session_key)
    except HermesError:
        return
    assert entry.origin is not None
    assert entry.origin.chat_name == clean_text(chat_name)
    assert entry.origin.chat_id == clean_text(chat_id)
    assert again is not None
    assert again.metadata[clean_text(extra)] == {clean_text(topic): [clean_text(content)]}
    assert stored["content"] == clean_text(content)
    assert stored["tool_name"] == clean_text(tool_name)
    assert stored["note"] == clean_text(extra)
    assert all(isinstance(hit.snippet, str) for hit in hits)
    assert store.health() == health  # no query changes the index's health


def test_search_takes_any_string_as_data(store: SessionStore) -> None:
    entry = store.get_or_create_session(telegram_dm())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "alpha OR beta"})
    health = store.health()
    for query in ("\x00", '"', "alpha OR", "NEAR(alpha beta)", "a*", "-", ":", "^", "\ud83d"):
        store.search(query)
    assert store.health() == health
    assert [hit.snippet for hit in store.search("alpha OR")] == ["alpha OR beta"]
    assert store.search("alpha NOT") == []  # words, not operators
    with pytest.raises(InvalidValueError, match="query"):
        store.search(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="limit"):
        store.search("alpha", limit="5")  # type: ignore[arg-type]


def test_unencodable_lookups_find_nothing(store: SessionStore) -> None:
    store.get_or_create_session(telegram_dm())
    assert store.lookup_by_session_id("id\ud83d") is None
    assert store.lookup_by_session_key("agent:main:telegram:dm:c=\ud83d") is None
    assert store.load_transcript("20260101_000000_abcdef12") == []


@pytest.mark.slow
@pytest.mark.parametrize("chat_id", ["\ud83d", "a\udfff", "1\x00", "\x001", "b\ud83d\ude00"])
def test_ids_that_cleaning_would_change_are_refused_not_merged(
    store: SessionStore, chat_id: str
) -> None:
    """Cleaning ``\\ud800`` and ``\\ud801`` (or ``1`` and ``1\\x00``) would give one key to two
    chats: such ids are refused by name, and no lane is created."""
    lane = store.get_or_create_session(telegram_dm("\ufffd"))
    with pytest.raises(InvalidValueError, match=r"chat_id .* is not a usable id"):
        store.get_or_create_session(telegram_dm(chat_id))
    with pytest.raises(InvalidValueError, match="user_id"):
        SessionSource(platform="telegram", chat_id="1", user_id=chat_id)
    assert [entry.session_key for entry in store.list_sessions()] == [lane.session_key]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "user", "content": "x", "timestamp": float("nan")}, "finite epoch"),
        ({"role": "user", "content": "x", "timestamp": float("inf")}, "finite epoch"),
        ({"role": "user", "content": "x", "token_count": 2**70}, "token_count"),
        ({"role": "user", "content": "x", "token_count": -1}, "token_count"),
        ({"role": ["user"], "content": "x"}, "role"),
        ({"role": "user", "content": {1: "x"}}, "non-string key"),
        ({"role": "user", "content": "x", "when": object()}, "not a JSON value"),
        ({"role": "user", "content": "x", "score": float("nan")}, "not a JSON value"),
    ],
)
def test_bad_messages_are_refused_by_name(
    store: SessionStore, message: dict[str, object], match: str
) -> None:
    entry = store.get_or_create_session(telegram_dm())
    with pytest.raises(InvalidValueError, match=match):
        store.append_to_transcript(entry.session_id, message)
    assert store.load_transcript(entry.session_id) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"input_tokens": 2**70}, "input_tokens"),
        ({"output_tokens": 1.5}, "output_tokens"),
        ({"estimated_cost_usd": float("inf")}, "estimated_cost_usd"),
        ({"estimated_cost_usd": 10**400}, "estimated_cost_usd"),
        ({"last_prompt_tokens": True}, "last_prompt_tokens"),
    ],
)
def test_counter_overflow_is_refused_and_nothing_changes(
    store: SessionStore, change: dict[str, object], match: str
) -> None:
    entry = store.get_or_create_session(telegram_dm())
    store.update_session(entry.session_key, input_tokens=5)
    with pytest.raises(InvalidValueError, match=match):
        store.update_session(entry.session_key, **change)  # type: ignore[arg-type]
    after = store.lookup_by_session_key(entry.session_key)
    assert after is not None
    assert (after.input_tokens, after.estimated_cost_usd) == (5, 0.0)
    row = store.session_row(entry.session_id)
    assert row is not None
    assert row.input_tokens == 5


# -- the full-text index: its faults fail open, others surface -------------------------------------


def _sqlite(tmp_path: Path) -> tuple[SessionStore, Callable[[str], None]]:
    home = tmp_path / "home"
    store = _open(home)

    def raw(statement: str) -> None:
        with sqlite3.connect(home / "state.db") as conn:
            conn.execute(statement)

    return store, raw


def _triggers(tmp_path: Path) -> set[str]:
    with sqlite3.connect(tmp_path / "home" / "state.db") as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall()
    return {name for (name,) in rows if name.startswith("messages_fts")}


def test_a_missing_fts_shadow_table_fails_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fts, "INDEX_EVERY", 1)  # each commit indexes its messages
    store, raw = _sqlite(tmp_path)
    entry = store.get_or_create_session(telegram_dm())
    raw("DROP TABLE messages_fts_idx")
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "kept"})
    assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["kept"]
    assert store.health()["fts"] == "stale"
    assert store.search("kept")[0].snippet == "kept"  # by scan meanwhile
    store.close()


def test_an_ordinary_write_error_leaves_the_index_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_fts, "INDEX_EVERY", 1)  # each commit indexes its messages
    store, _raw = _sqlite(tmp_path)
    store.get_or_create_session(telegram_dm())
    before = _triggers(tmp_path)
    with pytest.raises(TranscriptWriteError):  # no session row: a foreign-key failure
        store.append_to_transcript("20260101_000000_abcdef12", {"role": "user", "content": "x"})
    assert store.health()["fts"] == "ok"
    assert _triggers(tmp_path) == before == {"messages_fts_delete", "messages_fts_update"}
    store.close()


# -- the command line ------------------------------------------------------------------------------


def test_cli_key_and_explain_take_undecodable_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from hermes_core.cli.main import main

    undecodable = b"100\xff".decode("utf-8", "surrogateescape")  # as Python reads such argv
    assert main(["key", "--platform", "telegram", "--chat-id", undecodable]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hermes-sessions: error: ")
    assert "chat_id '100\\udcff' is not a usable id" in error
    assert len(error.splitlines()) == 1
    argv = ["explain", "--platform", "telegram", "--chat-type", "group", "--user-id", "u"]
    assert main([*argv, "--chat-id", "100", "--chat-name", "caf\ud83d"]) == 0
    assert "key: agent:main:telegram:group:c=100:u=u" in capsys.readouterr().out


# -- through the Gateway ---------------------------------------------------------------------------


class _HalfEmojiAgent(EchoAgent):
    """Answers with the first half of an emoji after the echo (an agent that cut its output)."""

    async def run_turn(self, request: TurnRequest) -> str | None:
        return f"{await super().run_turn(request)} \ud83d"


async def test_half_an_emoji_in_a_message_and_in_the_reply_is_answered_and_stored(
    hermes_home: Path,
) -> None:
    config = GatewayConfig.from_dict(
        {"gateway": {"housekeeping": {"initial_delay_secs": 3600}}},
        environ={"HERMES_HOME": str(hermes_home)},
    )
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(
        config, fresh_plugin_manager(hermes_home), lambda entry: _HalfEmojiAgent(), [adapter]
    )
    await gateway.start()
    source = SessionSource(
        platform="telegram", chat_id="-1001", chat_type="group", chat_name="caf\ud83d",
        user_id="u1", user_name="\x00bob\ude00",
    )  # fmt: skip
    await gateway.handle_message(MessageEvent(source=source, text="hi \ud83d", message_id="m1"))
    await gateway.idle()
    assert adapter.texts() == ["echo: hi \ufffd \ufffd"]
    entry = gateway.store.lookup_by_session_key("agent:main:telegram:group:c=-1001:u=u1")
    assert entry is not None
    assert entry.origin is not None
    assert (entry.origin.chat_name, entry.origin.user_name) == ("caf\ufffd", "bob\ufffd")
    stored = [m["content"] for m in gateway.store.load_transcript(entry.session_id)]
    assert stored == ["hi \ufffd", "echo: hi \ufffd \ufffd"]
    assert entry.active_turn_token is None  # the turn closed
    await gateway.stop()


def test_a_junk_queued_row_is_logged_cut_and_escaped(
    store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A queued row whose key holds newlines and 100 KB (written by anything but a gateway) is
    reported on one short line when the queue is read, not verbatim."""
    from sqlalchemy import create_engine, text

    junk = "agent:main:telegram:dm:c=1\nFORGED LOG LINE\n" + "x" * 100_000
    engine = create_engine(store.config.storage_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO queued_events (session_key, event_json, enqueued_at, updated_at) "
                "VALUES (:key, :payload, 0, 0)"
            ),
            {"key": junk, "payload": "not json"},
        )
    engine.dispose()
    with caplog.at_level("WARNING"):
        assert store._queue.restore() == []
    [record] = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert "\n" not in record.getMessage()
    assert len(record.getMessage()) < 1000
    assert f"({len(junk)} characters)" in record.getMessage()
