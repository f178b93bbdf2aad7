"""Key schema v2: injective, parseable, and the documented examples in both schemas."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_core import (
    InvalidValueError,
    SessionKeyParts,
    SessionSource,
    build_session_key,
    is_shared_multi_user_session,
    parse_session_key,
)
from hermes_core.domain.keys import profile_namespace
from hermes_plugins.whatsapp import canonical_whatsapp_identifier

G = "-1002285219667"

# The documented examples: (source fields, options, v1 key, v2 key).
EXAMPLES: list[tuple[dict[str, Any], dict[str, Any], str, str]] = [
    ({"platform": "telegram", "chat_id": "99"}, {},
     "agent:main:telegram:dm:99", "agent:main:telegram:dm:c=99"),
    ({"platform": "telegram", "chat_id": "", "user_id": "jordan"}, {},
     "agent:main:telegram:dm:jordan", "agent:main:telegram:dm:u=jordan"),
    ({"platform": "telegram", "chat_id": G, "chat_type": "group", "user_id": "alice"}, {},
     f"agent:main:telegram:group:{G}:alice", f"agent:main:telegram:group:c={G}:u=alice"),
    ({"platform": "telegram", "chat_id": G, "chat_type": "group", "user_id": "alice"},
     {"group_sessions_per_user": False},
     f"agent:main:telegram:group:{G}", f"agent:main:telegram:group:c={G}"),
    ({"platform": "telegram", "chat_id": G, "chat_type": "group", "thread_id": "17585",
      "user_id": "alice"}, {},
     f"agent:main:telegram:group:{G}:17585", f"agent:main:telegram:group:c={G}:t=17585"),
    ({"platform": "telegram", "chat_id": G, "chat_type": "group", "thread_id": "17585",
      "user_id": "42"}, {"thread_sessions_per_user": True},
     f"agent:main:telegram:group:{G}:17585:42", f"agent:main:telegram:group:c={G}:t=17585:u=42"),
    ({"platform": "whatsapp", "chat_id": "15551234567@s.whatsapp.net"}, {},
     "agent:main:whatsapp:dm:15551234567", "agent:main:whatsapp:dm:c=15551234567"),
    ({"platform": "slack", "chat_id": "C1", "chat_type": "group", "thread_id": "1111",
      "user_id": "U1", "scope_id": "T1"}, {},
     "agent:main:slack:group:T1:C1:1111", "agent:main:slack:group:s=T1:c=C1:t=1111"),
    ({"platform": "discord", "chat_id": "channel-1", "chat_type": "channel",
      "prospective_thread_id": "msg-100"}, {},
     "agent:main:discord:thread:channel-1:msg-100",
     "agent:main:discord:thread:c=channel-1:t=msg-100"),
    ({"platform": "telegram", "chat_id": "99"}, {"profile": "coder"},
     "agent:coder:telegram:dm:99", "agent:coder:telegram:dm:c=99"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "options", "v1", "v2"), EXAMPLES)
def test_documented_examples_in_both_schemas(
    fields: dict[str, Any], options: dict[str, Any], v1: str, v2: str
) -> None:
    source = SessionSource(**fields)
    assert build_session_key(source, schema="v1", **options) == v1
    assert build_session_key(source, schema="v2", **options) == v2
    assert build_session_key(source, **options) == v2  # v2 unless told


def test_forum_topic_and_member_share_a_v1_key_but_not_a_v2_key() -> None:
    topic = SessionSource(
        platform="telegram", chat_id=G, chat_type="group", thread_id="17585", user_id="111"
    )
    member = SessionSource(platform="telegram", chat_id=G, chat_type="group", user_id="17585")
    assert build_session_key(topic, schema="v1") == build_session_key(member, schema="v1")
    assert build_session_key(topic) == f"agent:main:telegram:group:c={G}:t=17585"
    assert build_session_key(member) == f"agent:main:telegram:group:c={G}:u=17585"


def test_ids_with_separators_and_escapes_stay_apart() -> None:
    one = SessionSource(platform="matrix", chat_id="!r:ex.org", chat_type="group", user_id="a")
    two = SessionSource(platform="matrix", chat_id="!r", chat_type="group", user_id="ex.org:a")
    assert build_session_key(one, schema="v1") == build_session_key(two, schema="v1")
    assert build_session_key(one) == "agent:main:matrix:group:c=!r%3Aex.org:u=a"
    assert build_session_key(two) == "agent:main:matrix:group:c=!r:u=ex.org%3Aa"
    escaped = SessionSource(platform="matrix", chat_id="%3A", chat_type="group")
    assert build_session_key(escaped, group_sessions_per_user=False) == (
        "agent:main:matrix:group:c=%253A"
    )


@pytest.mark.parametrize(
    "key",
    [
        "agent:main:telegram:dm:99",  # a v1 key: untagged
        "agent:main:telegram:dm:c=",  # empty component
        "agent:main:telegram:dm:u=1:c=2",  # out of order
        "agent:main:telegram:dm:c=1:c=2",  # repeated
        "agent:main:telegram:dm:c=a%41",  # an escape v2 never writes
        "agent:main:telegram:dm:c=a%2Eb",  # %2E only follows a dot
        "agent:main:telegram:dm:c=50%",  # a bare percent
        "agent:main:Telegram:dm",  # not a platform name
        "agent:default:telegram:dm",  # no profile has this namespace
        "agent:main:telegram",  # no slot
        "session:main:telegram:dm",
    ],
)
def test_parse_refuses_what_build_never_writes(key: str) -> None:
    with pytest.raises(InvalidValueError, match="is not a v2 session key"):
        parse_session_key(key)


# -- the property: the key components, written independently of the key code -------------------

IDS = st.one_of(
    st.sampled_from(["", "1", "17585", "42", ":", "%", "%3A", "%25", ".", "..", "a:b", "u=1",
                     "t=17585", "c=", "é", "日本", "🙂"]),
    st.text(alphabet="1:%.=tuc7é", max_size=6),
)  # fmt: skip
CHAT_TYPES = st.sampled_from(["dm", "group", "channel", "thread", "forum", "a:b", "a%b"])


@st.composite
def sources(draw: st.DrawFn) -> SessionSource:
    platform = draw(st.sampled_from(["telegram", "discord", "slack", "matrix", "whatsapp"]))
    return SessionSource(
        platform=platform, chat_type=draw(CHAT_TYPES), chat_id=draw(IDS),
        thread_id=draw(IDS | st.none()), prospective_thread_id=draw(IDS | st.none()),
        user_id=draw(IDS | st.none()), user_id_alt=draw(IDS | st.none()),
        scope_id=draw(IDS | st.none()),
    )  # fmt: skip


def components(
    source: SessionSource, profile: str | None, group_flag: bool, thread_flag: bool
) -> SessionKeyParts:
    """What the key rules keep apart: namespace, platform, slot, scope (Slack's workspace),
    chat id (WhatsApp DMs canonicalised), effective thread, and the participant when per user."""
    is_dm = source.chat_type == "dm"
    whatsapp = source.platform == "whatsapp"
    chat = source.chat_id
    if is_dm and chat and whatsapp:
        chat = canonical_whatsapp_identifier(chat)
    prospective = not is_dm and not source.thread_id and bool(source.prospective_thread_id)
    thread = source.thread_id or (source.prospective_thread_id if prospective else "") or ""
    per_user = not chat if is_dm else group_flag and (not thread or thread_flag)
    raw = source.user_id_alt or source.user_id or ""
    participant = ""
    if per_user and raw:
        participant = (canonical_whatsapp_identifier(raw) or raw) if whatsapp else raw
    scope = (source.scope_id or "") if source.platform == "slack" else ""
    slot = "thread" if prospective else source.chat_type
    return SessionKeyParts(
        profile_namespace(profile), source.platform, slot, scope, chat, thread, participant
    )


PROFILES = st.sampled_from([None, "default", "main", "coder"])


@pytest.mark.slow
@settings(max_examples=600)
@given(
    first=sources(), second=sources(), profiles=st.tuples(PROFILES, PROFILES),
    group_flag=st.booleans(), thread_flag=st.booleans(),
)  # fmt: skip
def test_v2_keys_are_injective_parseable_and_agree_with_the_predicate(
    first: SessionSource, second: SessionSource, profiles: tuple[str | None, str | None],
    group_flag: bool, thread_flag: bool,
) -> None:  # fmt: skip
    flags: dict[str, Any] = {
        "group_sessions_per_user": group_flag,
        "thread_sessions_per_user": thread_flag,
    }
    keys = []
    for source, profile in zip((first, second), profiles, strict=True):
        key = build_session_key(source, profile=profile, **flags)
        parts = parse_session_key(key)
        assert parts == components(source, profile, group_flag, thread_flag)
        assert ".." not in key
        assert key.isprintable()
        shared = is_shared_multi_user_session(source, **flags)
        assert shared is (source.chat_type != "dm" and not parts.participant)
        keys.append(key)
    same = components(first, profiles[0], group_flag, thread_flag) == components(
        second, profiles[1], group_flag, thread_flag
    )
    assert (keys[0] == keys[1]) is same


@given(first=sources())
def test_sources_that_meet_on_a_participant_or_thread_id_stay_apart(first: SessionSource) -> None:
    """The leak of v1: the same id as a thread in one source and as a sender in another."""
    shared_id = first.thread_id or "17585"
    topic = first.replace(chat_type="group", thread_id=shared_id, user_id="111")
    member = topic.replace(thread_id=None, prospective_thread_id=None, user_id=shared_id,
                           user_id_alt=None)  # fmt: skip
    assert build_session_key(topic) != build_session_key(member)
