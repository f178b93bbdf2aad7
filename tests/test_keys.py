"""Golden session keys: one row per rule, in key schema v1 (the original gateway's layout, kept
byte for byte) and, for the documented examples, v2. A changed key silently loses every live
session, so any change here must be deliberate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hermes_core
import hermes_core.keys as hermes_core_keys
from hermes_core import (
    GatewayConfig,
    InvalidValueError,
    SessionSource,
    UnknownPlatformError,
    build_key_from_flags,
    build_session_key,
    is_shared_multi_user_session,
    resolve_key,
    resolve_key_from_flags,
    resolve_session_key,
)
from hermes_core.domain.keys import (
    KEY_SCHEMAS,
    KeySchema,
    parse_session_key,
    profile_from_namespace,
    profile_namespace,
)
from hermes_plugins.whatsapp import canonical_whatsapp_identifier

TG_GROUP = "-1002285219667"
WA_PHONE = "60123456789"
WA_LID = "999999999999999"

# (row id, source fields, options, expected v1 key, rule, shared)
GOLDEN: list[tuple[str, dict[str, Any], dict[str, Any], str, str, bool]] = [
    ("dm-chat", {"platform": "telegram", "chat_id": "99"}, {},
     "agent:main:telegram:dm:99", "dm-chat", False),
    ("dm-chat ignores user", {"platform": "telegram", "chat_id": "99", "user_id": "42"}, {},
     "agent:main:telegram:dm:99", "dm-chat", False),
    ("dm-chat with thread", {"platform": "telegram", "chat_id": "99", "thread_id": "7"}, {},
     "agent:main:telegram:dm:99:7", "dm-chat", False),
    ("dm ignores prospective thread",
     {"platform": "telegram", "chat_id": "99", "prospective_thread_id": "p1"}, {},
     "agent:main:telegram:dm:99", "dm-chat", False),
    ("dm-participant", {"platform": "telegram", "chat_id": "", "user_id": "jordan"}, {},
     "agent:main:telegram:dm:jordan", "dm-participant", False),
    ("dm participant before thread",
     {"platform": "telegram", "chat_id": "", "user_id": "jordan", "thread_id": "7"}, {},
     "agent:main:telegram:dm:jordan:7", "dm-participant", False),
    ("dm-participant prefers alt id",
     {"platform": "signal", "chat_id": "", "user_id": "+15550001", "user_id_alt": "uuid-a"}, {},
     "agent:main:signal:dm:uuid-a", "dm-participant", False),
    ("dm-thread", {"platform": "telegram", "chat_id": "", "thread_id": "7"}, {},
     "agent:main:telegram:dm:7", "dm-thread", False),
    ("dm-sink", {"platform": "telegram", "chat_id": ""}, {},
     "agent:main:telegram:dm", "dm-sink", False),
    ("group-per-user",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "user_id": "alice"}, {},
     f"agent:main:telegram:group:{TG_GROUP}:alice", "group-per-user", False),
    ("group-shared by flag",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "user_id": "alice"},
     {"group_sessions_per_user": False},
     f"agent:main:telegram:group:{TG_GROUP}", "group-shared", True),
    ("group without sender id is shared",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group"}, {},
     f"agent:main:telegram:group:{TG_GROUP}", "group-shared", True),
    ("group alt id",
     {"platform": "signal", "chat_id": "grp", "chat_type": "group", "user_id": "+1555",
      "user_id_alt": "uuid-b"}, {},
     "agent:main:signal:group:grp:uuid-b", "group-per-user", False),
    ("channel per user",
     {"platform": "discord", "chat_id": "c1", "chat_type": "channel", "user_id": "u1"}, {},
     "agent:main:discord:channel:c1:u1", "group-per-user", False),
    ("custom chat type",
     {"platform": "telegram", "chat_id": "c", "chat_type": "forum", "user_id": "u"}, {},
     "agent:main:telegram:forum:c:u", "group-per-user", False),
    ("forum topic shared",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "user_id": "alice",
      "thread_id": "17585"}, {},
     f"agent:main:telegram:group:{TG_GROUP}:17585", "thread-shared", True),
    ("forum topic per user",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "user_id": "42",
      "thread_id": "17585"}, {"thread_sessions_per_user": True},
     f"agent:main:telegram:group:{TG_GROUP}:17585:42", "thread-per-user", False),
    ("thread per-user flag needs group flag",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "user_id": "42",
      "thread_id": "17585"},
     {"group_sessions_per_user": False, "thread_sessions_per_user": True},
     f"agent:main:telegram:group:{TG_GROUP}:17585", "thread-shared", True),
    ("thread per user without sender id is shared",
     {"platform": "telegram", "chat_id": TG_GROUP, "chat_type": "group", "thread_id": "17585"},
     {"thread_sessions_per_user": True},
     f"agent:main:telegram:group:{TG_GROUP}:17585", "thread-shared", True),
    ("discord thread",
     {"platform": "discord", "chat_id": "channel-1", "chat_type": "thread",
      "thread_id": "msg-100", "user_id": "u1"}, {},
     "agent:main:discord:thread:channel-1:msg-100", "thread-shared", True),
    ("discord prospective thread",
     {"platform": "discord", "chat_id": "channel-1", "chat_type": "channel",
      "prospective_thread_id": "msg-100", "user_id": "u1"}, {},
     "agent:main:discord:thread:channel-1:msg-100", "thread-shared", True),
    ("discord guild never in key",
     {"platform": "discord", "chat_id": "c1", "chat_type": "group", "user_id": "u1",
      "scope_id": "guild-9"}, {},
     "agent:main:discord:group:c1:u1", "group-per-user", False),
    ("slack thread with workspace",
     {"platform": "slack", "chat_id": "C1", "chat_type": "group", "thread_id": "1111",
      "user_id": "U1", "scope_id": "T1"}, {},
     "agent:main:slack:group:T1:C1:1111", "thread-shared", True),
    ("slack workspace from guild alias",
     {"platform": "slack", "chat_id": "C1", "chat_type": "group", "user_id": "U1",
      "guild_id": "T1"}, {},
     "agent:main:slack:group:T1:C1:U1", "group-per-user", False),
    ("slack without workspace",
     {"platform": "slack", "chat_id": "C1", "chat_type": "group", "user_id": "U1"}, {},
     "agent:main:slack:group:C1:U1", "group-per-user", False),
    ("slack dm with workspace",
     {"platform": "slack", "chat_id": "D1", "scope_id": "T1"}, {},
     "agent:main:slack:dm:T1:D1", "dm-chat", False),
    ("whatsapp dm jid", {"platform": "whatsapp", "chat_id": "15551234567@s.whatsapp.net"}, {},
     "agent:main:whatsapp:dm:15551234567", "dm-chat", False),
    ("whatsapp dm device jid",
     {"platform": "whatsapp", "chat_id": f"{WA_PHONE}:47@s.whatsapp.net"}, {},
     f"agent:main:whatsapp:dm:{WA_PHONE}", "dm-chat", False),
    ("whatsapp dm plus form", {"platform": "whatsapp", "chat_id": f"+{WA_PHONE}"}, {},
     f"agent:main:whatsapp:dm:{WA_PHONE}", "dm-chat", False),
    ("whatsapp dm lid without mapping", {"platform": "whatsapp", "chat_id": f"{WA_LID}@lid"}, {},
     f"agent:main:whatsapp:dm:{WA_LID}", "dm-chat", False),
    ("whatsapp group id never canonicalised, participant is",
     {"platform": "whatsapp", "chat_id": "120363@g.us", "chat_type": "group",
      "user_id": f"{WA_PHONE}:3@s.whatsapp.net"}, {},
     f"agent:main:whatsapp:group:120363@g.us:{WA_PHONE}", "group-per-user", False),
    ("profile", {"platform": "telegram", "chat_id": "99"}, {"profile": "coder"},
     "agent:coder:telegram:dm:99", "dm-chat", False),
    ("profile main", {"platform": "telegram", "chat_id": "99"}, {"profile": "main"},
     "agent:main~:telegram:dm:99", "dm-chat", False),
    ("profile default", {"platform": "telegram", "chat_id": "99"}, {"profile": "default"},
     "agent:main:telegram:dm:99", "dm-chat", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "options", "key", "rule", "shared"),
    [row[1:] for row in GOLDEN],
    ids=[row[0] for row in GOLDEN],
)
def test_golden_keys(
    fields: dict[str, Any], options: dict[str, Any], key: str, rule: str, shared: bool
) -> None:
    source = SessionSource(**fields)
    assert build_session_key(source, schema="v1", **options) == key
    resolution = resolve_session_key(source, schema="v1", **options)
    assert (resolution.rule, resolution.shared) == (rule, shared)
    flags = {name: value for name, value in options.items() if name != "profile"}
    assert is_shared_multi_user_session(source, **flags) is shared


def _write_mapping(directory: Path, name: str, target: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(target), encoding="utf-8")


@pytest.mark.parametrize(
    "mapping_dir", ["platforms/whatsapp/session", "whatsapp/session"], ids=["modern", "legacy"]
)
def test_whatsapp_lid_with_mapping_file(hermes_home: Path, mapping_dir: str) -> None:
    _write_mapping(
        hermes_home / mapping_dir,
        f"lid-mapping-{WA_LID}_reverse.json",
        f"{WA_PHONE}@s.whatsapp.net",
    )
    lid_dm = SessionSource(platform="whatsapp", chat_id=f"{WA_LID}@lid")
    phone_dm = SessionSource(platform="whatsapp", chat_id=f"+{WA_PHONE}")
    assert build_session_key(lid_dm, schema="v1") == f"agent:main:whatsapp:dm:{WA_PHONE}"
    assert build_session_key(lid_dm) == f"agent:main:whatsapp:dm:c={WA_PHONE}"
    assert build_session_key(lid_dm) == build_session_key(phone_dm)


def test_whatsapp_lid_participant_in_group_uses_mapping(hermes_home: Path) -> None:
    _write_mapping(
        hermes_home / "platforms/whatsapp/session",
        f"lid-mapping-{WA_LID}_reverse.json",
        f"{WA_PHONE}@s.whatsapp.net",
    )
    source = SessionSource(
        platform="whatsapp", chat_id="120363@g.us", chat_type="group", user_id=f"{WA_LID}@lid"
    )
    key = f"agent:main:whatsapp:group:120363@g.us:{WA_PHONE}"
    assert build_session_key(source, schema="v1") == key
    assert build_session_key(source) == f"agent:main:whatsapp:group:c=120363@g.us:u={WA_PHONE}"


def test_whatsapp_id_with_a_trailing_newline_is_not_looked_up(hermes_home: Path) -> None:
    directory = hermes_home / "platforms/whatsapp/session"
    _write_mapping(directory, "lid-mapping-12\n.json", "5@s.whatsapp.net")
    assert canonical_whatsapp_identifier("12\n@lid", hermes_home=hermes_home) == "12\n"


UNUSABLE_MAPPINGS = {
    "deep nesting": "[" * 2040 + "]" * 2040,  # within the 4 KiB a mapping file may have
    "large": json.dumps("6" * 5000),
    "list": json.dumps([f"{WA_PHONE}@s.whatsapp.net"]),
    "number": "60123456789",
    "not json": "60123456789@s.whatsapp.net",
}


@pytest.mark.parametrize("content", UNUSABLE_MAPPINGS.values(), ids=list(UNUSABLE_MAPPINGS))
def test_unusable_whatsapp_mapping_is_logged_once_and_ignored(
    hermes_home: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = hermes_home / "platforms/whatsapp/session"
    directory.mkdir(parents=True)
    (directory / f"lid-mapping-{WA_LID}.json").write_text(content, encoding="utf-8")
    (directory / f"lid-mapping-{WA_LID}_reverse.json").write_text(content, encoding="utf-8")
    dm = SessionSource(platform="whatsapp", chat_id=f"{WA_LID}@lid")
    participant = SessionSource(
        platform="whatsapp", chat_id="120363@g.us", chat_type="group", user_id=f"{WA_LID}@lid"
    )
    with caplog.at_level("WARNING", logger="hermes_plugins.whatsapp"):
        assert build_session_key(dm) == f"agent:main:whatsapp:dm:c={WA_LID}"
        assert build_session_key(participant).endswith(f":u={WA_LID}")
    warnings = [r.getMessage() for r in caplog.records if r.name == "hermes_plugins.whatsapp"]
    assert len(warnings) == 1
    assert str(directory) in warnings[0]
    assert WA_LID not in warnings[0].replace(str(directory), "")


def test_thread_keys_equal_for_prospective_and_real_thread() -> None:
    channel = SessionSource(
        platform="discord", chat_id="c1", chat_type="channel", prospective_thread_id="t9"
    )
    in_thread = SessionSource(platform="discord", chat_id="c1", chat_type="thread", thread_id="t9")
    variants: list[dict[str, Any]] = [
        {},
        {"group_sessions_per_user": False},
        {"thread_sessions_per_user": True},
    ]
    for flags in variants:
        for schema in KEY_SCHEMAS:
            assert build_session_key(channel, schema=schema, **flags) == build_session_key(
                in_thread, schema=schema, **flags
            )


def test_unregistered_platform_is_a_named_error() -> None:
    source = SessionSource(platform="myspace", chat_id="1")
    with pytest.raises(UnknownPlatformError, match=r"'myspace' is not a registered platform"):
        build_session_key(source)


@pytest.mark.parametrize(
    ("fields", "schemas", "problem"),
    [
        ({"chat_id": "a..b"}, ("v1",), "'..'"),
        ({"chat_id": "a\x01b"}, KEY_SCHEMAS, "control characters"),
        ({"chat_id": "x" * 1100}, KEY_SCHEMAS, "1-1024"),
    ],
)
def test_source_producing_an_invalid_key_is_refused(
    fields: dict[str, str], schemas: tuple[KeySchema, ...], problem: str
) -> None:
    source = SessionSource(platform="telegram", **fields)
    for schema in schemas:
        with pytest.raises(InvalidValueError, match=problem) as info:
            build_session_key(source, schema=schema)
        assert info.value.field == "source"


def test_v2_escapes_dots_so_an_id_with_two_dots_is_keyed() -> None:
    source = SessionSource(platform="telegram", chat_id="a..b")
    assert build_session_key(source) == "agent:main:telegram:dm:c=a.%2Eb"


def test_invalid_profile_is_refused() -> None:
    source = SessionSource(platform="telegram", chat_id="99")
    with pytest.raises(InvalidValueError, match=r"profile '\.\./x' is not valid"):
        build_session_key(source, profile="../x")


@pytest.mark.parametrize("profile", ["coder\n", "coder\r\n", "\ncoder"])
def test_profile_with_a_newline_is_refused(profile: str) -> None:
    with pytest.raises(InvalidValueError, match=r"profile .* is not valid") as info:
        profile_namespace(profile)
    assert info.value.field == "profile"


@pytest.mark.parametrize("profile", ["default", "main", "coder", "a.b-c_1"])
def test_namespace_inverse(profile: str) -> None:
    namespace = profile_namespace(profile)
    assert profile_from_namespace(namespace) == profile


def _oracle_shared(source: SessionSource, group_flag: bool, thread_flag: bool) -> bool:
    """The multi-user table, written independently of the key code."""
    if source.chat_type == "dm":
        return False
    has_sender = bool(source.user_id_alt or source.user_id)
    if source.thread_id or source.prospective_thread_id:
        return not (group_flag and thread_flag and has_sender)
    return not group_flag or not has_sender


def _ids(*values: str) -> st.SearchStrategy[str | None]:
    return st.one_of(st.none(), st.just(""), st.sampled_from(values))


@given(
    platform=st.sampled_from(["telegram", "discord", "slack", "signal", "matrix"]),
    chat_type=st.sampled_from(["dm", "group", "channel", "thread", "forum"]),
    chat_id=st.sampled_from(["", "c1", "-100"]),
    user_id=_ids("u1", "u42"),
    user_id_alt=_ids("alt-1"),
    thread_id=_ids("t1", "t2"),
    prospective=_ids("p1"),
    group_flag=st.booleans(),
    thread_flag=st.booleans(),
)
def test_predicate_matches_spec_table_and_key(
    platform: str, chat_type: str, chat_id: str, user_id: str | None, user_id_alt: str | None,
    thread_id: str | None, prospective: str | None, group_flag: bool, thread_flag: bool,
) -> None:  # fmt: skip
    source = SessionSource(
        platform=platform, chat_type=chat_type, chat_id=chat_id, user_id=user_id,
        user_id_alt=user_id_alt, thread_id=thread_id, prospective_thread_id=prospective,
    )  # fmt: skip
    flags: dict[str, Any] = {
        "group_sessions_per_user": group_flag,
        "thread_sessions_per_user": thread_flag,
    }
    shared = is_shared_multi_user_session(source, **flags)
    assert shared is _oracle_shared(source, group_flag, thread_flag)
    participant = source.user_id_alt or source.user_id
    if chat_type != "dm" and participant:
        assert build_session_key(source, schema="v1", **flags).endswith(f":{participant}") is (
            not shared
        )
        assert bool(parse_session_key(build_session_key(source, **flags)).participant) is (
            not shared
        )


def test_resolve_key_applies_the_configuration_and_the_from_flags_functions_do_not(
    hermes_home: Path,
) -> None:
    """A host calls ``resolve_key`` with its configuration; the ``*_from_flags`` functions take
    the flags, profile and schema as arguments and read none of it."""
    config = GatewayConfig.from_dict(
        {
            "platforms": {"telegram": {"group_sessions_per_user": False}},
            "gateway": {"multiplex_profiles": True},
            "keys": {"schema": "v1"},
        },
        environ={"HERMES_HOME": str(hermes_home)},
    )
    source = SessionSource(
        platform="telegram", chat_id="-100", chat_type="group", user_id="7", profile="ops"
    )
    resolution = resolve_key(source, config)
    assert (resolution.key, resolution.shared) == ("agent:ops:telegram:group:-100", True)
    assert resolve_key(source, config, schema="v2").key == "agent:ops:telegram:group:c=-100"
    assert build_key_from_flags(source) == "agent:main:telegram:group:c=-100:u=7"
    assert (
        resolve_key_from_flags(source, group_sessions_per_user=False, profile="ops", schema="v1")
        == resolution
    )


def test_the_key_function_names_of_earlier_releases_still_work() -> None:
    assert hermes_core.build_session_key is build_key_from_flags
    assert hermes_core.resolve_session_key is resolve_key_from_flags
    assert hermes_core_keys.resolve_for_config is resolve_key
    assert {"build_session_key", "resolve_session_key", "resolve_key"} <= set(hermes_core.__all__)
