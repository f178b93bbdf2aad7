"""SessionSource, SessionEntry and MessageEvent: serialisation, guards and untrusted input."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hermes_core import (
    HermesError,
    InvalidValueError,
    MessageEvent,
    MessageType,
    PlatformSpec,
    SessionEntry,
    SessionSource,
    UnknownPlatformError,
)

NOW = datetime(2026, 11, 30, 7, 52, 0, 123456, tzinfo=timezone.utc)


def _full_source() -> SessionSource:
    return SessionSource(
        platform="slack", chat_id="C1", chat_name="général", chat_type="group", user_id="U1",
        user_name="Ana", thread_id="1111.2", chat_topic="topic", user_id_alt="alt",
        chat_id_alt="calt", is_bot=True, scope_id="T1", parent_chat_id="P", message_id="m1",
        role_authorized=True, profile="coder", auto_thread_created=True,
        auto_thread_initial_name="name", prospective_thread_id="pt",
    )  # fmt: skip


def test_source_to_dict_order_and_omissions() -> None:
    data = _full_source().to_dict()
    assert list(data) == [
        "platform", "chat_id", "chat_name", "chat_type", "user_id", "user_name", "thread_id",
        "chat_topic", "user_id_alt", "chat_id_alt", "scope_id", "guild_id", "parent_chat_id",
        "message_id", "profile", "auto_thread_created", "auto_thread_initial_name",
        "prospective_thread_id",
    ]  # fmt: skip
    assert data["guild_id"] == data["scope_id"] == "T1"
    minimal = SessionSource(platform="telegram", chat_id="99").to_dict()
    assert minimal == {
        "platform": "telegram", "chat_id": "99", "chat_name": None, "chat_type": "dm",
        "user_id": None, "user_name": None, "thread_id": None, "chat_topic": None,
    }  # fmt: skip


def test_source_round_trip_drops_trust_flags() -> None:
    source = _full_source()
    back = SessionSource.from_dict(source.to_dict())
    assert back.to_dict() == source.to_dict()
    assert back.is_bot is False
    assert back.role_authorized is False
    assert json.dumps(back.to_dict(), ensure_ascii=False) == json.dumps(
        source.to_dict(), ensure_ascii=False
    )
    assert "général" in json.dumps(source.to_dict(), ensure_ascii=False)


@pytest.mark.parametrize(
    ("fields", "scope", "guild"),
    [
        ({"guild_id": "G"}, "G", "G"),
        ({"scope_id": "S"}, "S", "S"),
        ({"scope_id": "S", "guild_id": "G"}, "S", "S"),
        ({}, None, None),
    ],
)
def test_scope_alias(fields: dict[str, str], scope: str | None, guild: str | None) -> None:
    source = SessionSource(platform="discord", chat_id="c", **fields)
    assert (source.scope_id, source.guild_id) == (scope, guild)


@pytest.mark.parametrize(
    ("fields", "description"),
    [
        ({"platform": "local", "chat_id": "x", "chat_type": "group"}, "CLI terminal"),
        ({"user_name": "Alice", "user_id": "1"}, "DM with Alice"),
        ({"user_id": "1"}, "DM with 1"),
        ({}, "DM with user"),
        ({"chat_type": "group", "chat_name": "My Group", "thread_id": "12345"},
         "group: My Group, thread: 12345"),
        ({"chat_type": "group"}, "group: c9"),
        ({"chat_type": "channel", "chat_name": "news"}, "channel: news"),
        ({"chat_type": "forum", "chat_name": "Board"}, "Board"),
        ({"chat_type": "thread"}, "c9"),
    ],
)  # fmt: skip
def test_description(fields: dict[str, str], description: str) -> None:
    base: dict[str, Any] = {"platform": "telegram", "chat_id": "c9"}
    assert SessionSource(**{**base, **fields}).description == description


def test_source_is_immutable_and_replace_validates() -> None:
    source = SessionSource(platform="telegram", chat_id="1")
    with pytest.raises(ValueError, match="frozen"):
        source.chat_id = "2"  # type: ignore[misc]
    assert source.replace(chat_id="2").chat_id == "2"
    with pytest.raises(InvalidValueError, match="chat_type"):
        source.replace(chat_type="")


def test_empty_chat_type_is_named_error() -> None:
    with pytest.raises(InvalidValueError) as info:
        SessionSource(platform="telegram", chat_id="1", chat_type="")
    assert info.value.field == "chat_type"
    assert isinstance(info.value, HermesError)


def test_from_dict_coercions() -> None:
    source = SessionSource.from_dict(
        {"platform": "telegram", "chat_id": -1002285219667, "user_id": 42, "chat_type": None,
         "guild_id": "G", "auto_thread_created": "false", "unknown": 1, "is_bot": True}
    )  # fmt: skip
    assert (source.chat_id, source.user_id, source.chat_type) == ("-1002285219667", "42", "dm")
    assert (source.scope_id, source.auto_thread_created, source.is_bot) == ("G", False, False)
    assert SessionSource.from_dict({"platform": "telegram", "chat_id": None}).chat_id == ""


@pytest.mark.parametrize(
    ("data", "field", "error"),
    [
        ({"chat_id": "1"}, "platform", InvalidValueError),
        ({"platform": "nope", "chat_id": "1"}, "platform", UnknownPlatformError),
        ({"platform": "telegram"}, "chat_id", InvalidValueError),
        ({"platform": "telegram", "chat_id": True}, "chat_id", InvalidValueError),
        ({"platform": "telegram", "chat_id": "1", "chat_name": 5}, "chat_name", InvalidValueError),
        ({"platform": "telegram", "chat_id": "1", "chat_type": ""}, "chat_type", InvalidValueError),
    ],
)
def test_from_dict_errors_name_the_field(
    data: dict[str, Any], field: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        SessionSource.from_dict(data)
    assert isinstance(info.value, InvalidValueError)
    assert info.value.field == field
    assert field in str(info.value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
_field_names = st.sampled_from(
    ["platform", "chat_id", "chat_type", "user_id", "thread_id", "scope_id", "guild_id",
     "chat_name", "auto_thread_created", "prospective_thread_id", "profile", "other"]
)  # fmt: skip


@given(
    data=st.dictionaries(_field_names, _json, max_size=8)
    | st.fixed_dictionaries(
        {"platform": st.sampled_from(["telegram", "slack", "whatsapp"]), "chat_id": _json},
        optional={"user_id": _json, "chat_type": _json, "thread_id": _json, "guild_id": _json},
    )
    | _json
)
def test_from_dict_on_arbitrary_input_returns_source_or_named_error(data: object) -> None:
    try:
        source = SessionSource.from_dict(data)
    except InvalidValueError:
        return
    assert SessionSource.from_dict(source.to_dict()).to_dict() == source.to_dict()


_text = st.text(max_size=12)
_opt = st.none() | _text
_ID_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")
_id = st.text(_ID_CHARS, max_size=12)
"""An id: ids holding NUL or a lone surrogate are refused, so neither is drawn (``st.characters``
can draw a surrogate: a run once drew ``'\\ud800'``)."""
_opt_id = st.none() | _id


@given(
    chat_id=_id, chat_name=_opt, user_id=_opt_id,
    chat_type=st.text(_ID_CHARS, min_size=1, max_size=8),
    user_name=_opt, thread_id=_opt_id, scope_id=_opt_id, guild_id=_opt_id, profile=_opt,
    auto=st.booleans(), prospective=_opt_id,
)  # fmt: skip
def test_round_trip_is_byte_stable(
    chat_id: str, chat_name: str | None, chat_type: str, user_id: str | None,
    user_name: str | None, thread_id: str | None, scope_id: str | None, guild_id: str | None,
    profile: str | None, auto: bool, prospective: str | None,
) -> None:  # fmt: skip
    source = SessionSource(
        platform="discord", chat_id=chat_id, chat_name=chat_name, chat_type=chat_type,
        user_id=user_id, user_name=user_name, thread_id=thread_id, scope_id=scope_id,
        guild_id=guild_id, profile=profile, auto_thread_created=auto,
        prospective_thread_id=prospective,
    )  # fmt: skip
    once = source.to_dict()
    twice = SessionSource.from_dict(once).to_dict()
    assert json.dumps(twice, ensure_ascii=False) == json.dumps(once, ensure_ascii=False)


# -- SessionEntry -------------------------------------------------------------------------------


def _entry(**changes: Any) -> SessionEntry:
    fields: dict[str, Any] = {
        "session_key": "agent:main:telegram:dm:99", "session_id": "20261130_075200_0a1b2c3d",
        "created_at": NOW, "updated_at": NOW,
    }  # fmt: skip
    return SessionEntry(**{**fields, **changes})


def test_entry_to_dict_order_and_format() -> None:
    origin = SessionSource(platform="telegram", chat_id="99")
    data = _entry(origin=origin, platform="telegram", active_turn_token="a" * 32,
                  active_turn_started_at=NOW).to_dict()  # fmt: skip
    assert list(data)[:4] == ["session_key", "session_id", "created_at", "updated_at"]
    assert list(data)[-2:] == ["prev_session_id", "origin"]
    assert data["created_at"] == "2026-11-30T07:52:00.123456+00:00"
    assert "origin" not in _entry().to_dict()
    whole_second = _entry(created_at=NOW.replace(microsecond=0)).to_dict()
    assert whole_second["created_at"] == "2026-11-30T07:52:00.000000+00:00"


def test_entry_round_trip() -> None:
    entry = _entry(
        origin=SessionSource(platform="telegram", chat_id="99"), platform="telegram",
        metadata={"a": [1, 2]}, input_tokens=5, suspended=True, resume_pending=True,
        resume_reason="restart_timeout", last_resume_marked_at=NOW, prev_session_id="old",
        active_turn_token="b" * 32, active_turn_started_at=NOW,
    )  # fmt: skip
    assert SessionEntry.from_dict(entry.to_dict()).to_dict() == entry.to_dict()


def test_entry_from_dict_is_lenient_with_older_data() -> None:
    data = _entry().to_dict()
    data.update(
        model_override="gpt", memory_flushed=True, metadata=None, platform="gone",
        input_tokens="many", last_resume_marked_at="garbage", resume_pending=True,
    )  # fmt: skip
    del data["expiry_finalized"]
    entry = SessionEntry.from_dict(data)
    assert entry.expiry_finalized is True
    assert entry.metadata == {}
    assert entry.platform is None
    assert entry.input_tokens == 0
    assert entry.last_resume_marked_at is None
    assert entry.resume_pending is True
    assert "model_override" not in entry.to_dict()


@pytest.mark.parametrize(
    ("token", "started", "expected"),
    [
        ("c" * 32, "garbage", ("c" * 32, None)),
        ("", "2026-11-30T07:52:00+00:00", (None, None)),
        (None, "2026-11-30T07:52:00+00:00", (None, None)),
        (7, "2026-11-30T07:52:00+00:00", (None, None)),
    ],
)
def test_marker_pair_is_all_or_nothing(
    token: object, started: str, expected: tuple[str | None, None]
) -> None:
    data = {**_entry().to_dict(), "active_turn_token": token, "active_turn_started_at": started}
    entry = SessionEntry.from_dict(data)
    assert (entry.active_turn_token, entry.active_turn_started_at) == expected


def test_naive_datetime_is_host_local(local_timezone: Callable[[str], None]) -> None:
    local_timezone("Asia/Tokyo")
    entry = SessionEntry.from_dict({**_entry().to_dict(), "created_at": "2026-11-30T16:52:00"})
    assert entry.created_at == datetime(2026, 11, 30, 7, 52, tzinfo=timezone.utc)
    assert entry.created_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize("missing", ["session_key", "session_id", "created_at", "updated_at"])
def test_entry_required_fields(missing: str) -> None:
    data = _entry().to_dict()
    del data[missing]
    with pytest.raises(InvalidValueError) as info:
        SessionEntry.from_dict(data)
    assert info.value.field == missing


@pytest.mark.parametrize(
    "session_id", ["../etc", "a..b", "", "-lead", "a/b", "x" * 129, "a b", "abc\n", "abc\r\n"]
)
def test_session_id_guard(session_id: str) -> None:
    with pytest.raises(InvalidValueError, match="session_id"):
        _entry(session_id=session_id)


@pytest.mark.parametrize("name", ["telegram\n", "telegram\r\n", "\ntelegram"])
def test_platform_name_with_a_newline_is_refused(name: str) -> None:
    with pytest.raises(InvalidValueError, match="must match"):
        SessionSource(platform=name, chat_id="1")
    with pytest.raises(ValueError, match="must match"):
        PlatformSpec(name=name)


@pytest.mark.parametrize(
    "key", ["", "/abs", "\\win", "C:drive", "a..b", "a\x00b", "a\nb", "k" * 1025]
)
def test_session_key_guard(key: str) -> None:
    with pytest.raises(InvalidValueError, match="session_key"):
        _entry(session_key=key)


def test_session_key_guard_allows_interior_slash() -> None:
    assert _entry(session_key="agent:main:x:spaces/1/threads/2").session_key.count("/") == 3


def test_unregistered_origin_platform_makes_entry_unloadable() -> None:
    data = {**_entry().to_dict(), "origin": {"platform": "gone", "chat_id": "1"}}
    with pytest.raises(UnknownPlatformError):
        SessionEntry.from_dict(data)


# -- MessageEvent -------------------------------------------------------------------------------


def test_event_round_trip_all_fields() -> None:
    event = MessageEvent(
        source=SessionSource(platform="telegram", chat_id="99"), text="hi",
        message_type=MessageType.PHOTO, message_id="m", reply_to_message_id="r",
        media_urls=("a.jpg", "b.jpg"), internal=True, queued_via_command=True,
        bound_session_id="s1", received_at=NOW, metadata={"resume": True},
    )  # fmt: skip
    back = MessageEvent.from_dict(json.loads(json.dumps(event.to_dict())))
    assert back == event
    assert len(MessageEvent(source=event.source).event_id) == 32


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({}, "source"),
        ({"source": {"platform": "telegram", "chat_id": "1"}, "message_type": "hologram"},
         "message_type"),
        ({"source": {"platform": "telegram", "chat_id": "1"}, "media_urls": "x"}, "media_urls"),
        ({"source": {"platform": "telegram", "chat_id": "1"}, "received_at": "soon"},
         "received_at"),
        ({"source": {"platform": "telegram", "chat_id": "1"}, "text": 3}, "text"),
        ({"source": {"platform": "telegram"}}, "chat_id"),
    ],
)  # fmt: skip
def test_event_from_dict_errors(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidValueError) as info:
        MessageEvent.from_dict(data)
    assert info.value.field == field


@given(
    data=_json
    | st.dictionaries(
        st.sampled_from(["source", "text", "media_urls", "message_type", "received_at"]), _json
    )
)
def test_event_from_dict_on_arbitrary_input(data: object) -> None:
    with contextlib.suppress(InvalidValueError):
        MessageEvent.from_dict(data)


def test_an_entry_copy_is_equal_and_independent() -> None:
    """``model_copy`` (the store copies entries on every read and write) gives an equal entry
    whose changes, and whose record of the fields given, leave the original alone."""
    original = _entry(metadata={"topic": "x"}, resume_reason="restart_timeout")
    fields_given = set(original.model_fields_set)
    assert copy.copy(original) == original
    assert copy.copy(original) is not original
    changed = original.model_copy(update={"suspended": True, "metadata": {}})
    assert changed.suspended
    assert changed.metadata == {}
    assert changed.origin is original.origin
    assert not original.suspended
    assert original.metadata == {"topic": "x"}
    assert original.model_fields_set == fields_given
    assert changed.model_fields_set == fields_given | {"suspended", "metadata"}
    assert changed.to_dict() == {**original.to_dict(), "suspended": True, "metadata": {}}
