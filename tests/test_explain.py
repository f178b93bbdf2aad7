"""explain_session_key and the session-type lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hermes_core.cli.explain import explain_session_key, format_explanation
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import UnknownPlatformError
from hermes_core.domain.keys import build_session_key
from hermes_core.domain.models import SessionSource
from hermes_core.gateway.context import session_type_line
from hermes_core.plugins.manager import create_plugin_manager

THREAD_LINE = (
    "**Session type:** Multi-user thread — messages are prefixed with [sender name]. "
    "Multiple users may participate."
)
SESSION_LINE = (
    "**Session type:** Multi-user session — messages are prefixed with [sender name]. "
    "Multiple users may participate."
)
GROUP = "-1002285219667"


def _config(tmp_path: Path, data: dict[str, Any] | None = None) -> GatewayConfig:
    return GatewayConfig.from_dict(data or {}, environ={"HERMES_HOME": str(tmp_path)})


def _explain(tmp_path: Path, data: dict[str, Any] | None = None, **source: Any) -> dict[str, Any]:
    return explain_session_key(SessionSource(**source), _config(tmp_path, data))


def test_session_type_lines_are_exact() -> None:
    assert session_type_line(thread=True) == THREAD_LINE
    assert session_type_line(thread=False) == SESSION_LINE


def test_telegram_dm(tmp_path: Path) -> None:
    result = _explain(tmp_path, platform="telegram", chat_id="99", user_id="jordan")
    assert result == {
        "key": "agent:main:telegram:dm:c=99",
        "key_schema": {"value": "v2", "origin": "default"},
        "warnings": [],
        "platform": "telegram",
        "platform_plugin": "telegram",
        "namespace": "agent:main",
        "namespace_reason": "gateway.multiplex_profiles is off: every key uses agent:main",
        "rule": "dm-chat",
        "prospective_thread": False,
        "flags": {
            "group_sessions_per_user": {"value": True, "origin": "default"},
            "thread_sessions_per_user": {"value": False, "origin": "default"},
        },
        "canonicalisation": {"dm_chat_id": None, "participant": None},
        "scope": {
            "component": None,
            "reason": "telegram supplies no scope component: the guild or workspace (scope_id) "
            "is never part of the key",
        },
        "shared_multi_user_session": False,
        "session_type_line": None,
    }
    assert list(result) == [
        "key", "key_schema", "warnings", "platform", "platform_plugin", "namespace",
        "namespace_reason", "rule",
        "prospective_thread", "flags", "canonicalisation", "scope", "shared_multi_user_session",
        "session_type_line",
    ]  # fmt: skip
    json.dumps(result)  # JSON-ready


def test_shared_forum_topic_has_the_thread_line(tmp_path: Path) -> None:
    result = _explain(
        tmp_path, platform="telegram", chat_type="group", chat_id=GROUP, user_id="alice",
        thread_id="17585",
    )  # fmt: skip
    assert result["key"] == f"agent:main:telegram:group:c={GROUP}:t=17585"
    assert result["rule"] == "thread-shared"
    assert result["shared_multi_user_session"] is True
    assert result["session_type_line"] == THREAD_LINE


def test_group_shared_by_top_level_flag(tmp_path: Path) -> None:
    result = _explain(
        tmp_path, {"group_sessions_per_user": False},
        platform="telegram", chat_type="group", chat_id=GROUP, user_id="alice",
    )  # fmt: skip
    assert result["key"] == f"agent:main:telegram:group:c={GROUP}"
    assert result["rule"] == "group-shared"
    assert result["flags"]["group_sessions_per_user"] == {"value": False, "origin": "top level"}
    assert result["flags"]["thread_sessions_per_user"] == {"value": False, "origin": "default"}
    assert result["session_type_line"] == SESSION_LINE


def test_group_shared_by_platform_override(tmp_path: Path) -> None:
    data = {"platforms": {"telegram": {"group_sessions_per_user": False}}}
    group = {"chat_type": "group", "chat_id": GROUP, "user_id": "alice"}
    telegram = _explain(tmp_path, data, platform="telegram", **group)
    assert telegram["flags"]["group_sessions_per_user"] == {
        "value": False,
        "origin": "platform override",
    }
    assert telegram["rule"] == "group-shared"
    assert telegram["shared_multi_user_session"] is True
    discord = _explain(tmp_path, data, platform="discord", **group)
    assert discord["flags"]["group_sessions_per_user"] == {"value": True, "origin": "default"}
    assert discord["rule"] == "group-per-user"
    assert discord["key"] == f"agent:main:discord:group:c={GROUP}:u=alice"


@pytest.mark.parametrize(
    ("multiplex", "profile", "namespace", "reason_part"),
    [
        (True, "main", "agent:main~", "does not collide with the default profile's agent:main"),
        (True, "coder", "agent:coder", "profile 'coder' uses agent:coder"),
        (True, "default", "agent:main", "profile 'default' uses agent:main"),
        (True, None, "agent:main", "the source names no profile"),
        (False, "coder", "agent:main", "the source's profile 'coder' is ignored"),
    ],
)
def test_namespace_and_reason(
    tmp_path: Path, multiplex: bool, profile: str | None, namespace: str, reason_part: str
) -> None:
    result = _explain(
        tmp_path, {"gateway": {"multiplex_profiles": multiplex}},
        platform="telegram", chat_id="99", profile=profile,
    )  # fmt: skip
    assert result["namespace"] == namespace
    assert result["key"] == f"{namespace}:telegram:dm:c=99"
    assert reason_part in result["namespace_reason"]


def test_discord_prospective_thread_matches_the_later_thread_key(tmp_path: Path) -> None:
    result = _explain(
        tmp_path, platform="discord", chat_type="group", chat_id="channel-1", user_id="u1",
        scope_id="G1", prospective_thread_id="msg-100",
    )  # fmt: skip
    assert result["key"] == "agent:main:discord:thread:c=channel-1:t=msg-100"  # slot ``thread``
    assert result["prospective_thread"] is True
    assert result["rule"] == "thread-shared"
    assert result["session_type_line"] == THREAD_LINE
    assert result["scope"]["component"] is None
    assert "(scope_id 'G1') is never part of the key" in result["scope"]["reason"]
    later = _explain(
        tmp_path, platform="discord", chat_type="thread", chat_id="channel-1", user_id="u2",
        thread_id="msg-100",
    )  # fmt: skip
    assert later["key"] == result["key"]
    assert later["prospective_thread"] is False


@pytest.mark.parametrize(
    ("scope_id", "key", "component", "reason_part"),
    [
        ("T1", "agent:main:slack:group:s=T1:c=C1:t=1111", "T1", "this source has one"),
        (None, "agent:main:slack:group:c=C1:t=1111", None, "this source has none"),
    ],
)
def test_slack_scope(
    tmp_path: Path, scope_id: str | None, key: str, component: str | None, reason_part: str
) -> None:
    result = _explain(
        tmp_path, platform="slack", chat_type="group", chat_id="C1", thread_id="1111",
        user_id="U1", scope_id=scope_id,
    )  # fmt: skip
    assert result["key"] == key
    assert result["scope"]["component"] == component
    assert reason_part in result["scope"]["reason"]
    assert result["platform_plugin"] == "slack"


def _whatsapp_mapping(tmp_path: Path) -> None:
    directory = tmp_path / "platforms" / "whatsapp" / "session"
    directory.mkdir(parents=True)
    reverse = directory / "lid-mapping-999999999999999_reverse.json"
    reverse.write_text(json.dumps("60123456789@s.whatsapp.net"), encoding="utf-8")


def test_whatsapp_dm_aliases_and_winner(tmp_path: Path) -> None:
    _whatsapp_mapping(tmp_path)
    result = _explain(
        tmp_path, platform="whatsapp", chat_id="999999999999999@lid",
        user_id="999999999999999@lid",
    )  # fmt: skip
    assert result["key"] == "agent:main:whatsapp:dm:c=60123456789"
    dm_chat_id = result["canonicalisation"]["dm_chat_id"]
    assert dm_chat_id["raw"] == "999999999999999@lid"
    assert dm_chat_id["canonical"] == "60123456789"
    assert dm_chat_id["in_key"] is True
    assert set(dm_chat_id["aliases"]) == {"999999999999999", "60123456789"}
    participant = result["canonicalisation"]["participant"]
    assert participant["canonical"] == "60123456789"
    assert participant["in_key"] is False  # a DM with a chat id is keyed by the chat


def test_whatsapp_group_participant_is_canonical_in_the_key(tmp_path: Path) -> None:
    _whatsapp_mapping(tmp_path)
    result = _explain(
        tmp_path, platform="whatsapp", chat_type="group", chat_id="120363@g.us",
        user_id="999999999999999@lid",
    )  # fmt: skip
    assert result["key"] == "agent:main:whatsapp:group:c=120363@g.us:u=60123456789"
    assert result["canonicalisation"]["dm_chat_id"] is None  # group ids are never canonicalised
    assert result["canonicalisation"]["participant"]["in_key"] is True


def test_explain_agrees_with_build_session_key_and_writes_nothing(tmp_path: Path) -> None:
    config = _config(tmp_path)
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    source = SessionSource(platform="telegram", chat_type="group", chat_id=GROUP, user_id="a")
    before = sorted(tmp_path.rglob("*"))
    result = explain_session_key(source, config, plugins)
    assert result["key"] == build_session_key(source, plugins=plugins)
    assert sorted(tmp_path.rglob("*")) == before


def test_unknown_platform_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(UnknownPlatformError, match="'nosuch'"):
        _explain(tmp_path, platform="nosuch", chat_id="1")


def test_format_explanation_lines(tmp_path: Path) -> None:
    _whatsapp_mapping(tmp_path)
    dm = _explain(tmp_path, platform="telegram", chat_id="99")
    assert format_explanation(dm) == [
        "key: agent:main:telegram:dm:c=99",
        "key schema: v2 (default)",
        "platform: telegram (plugin telegram)",
        "namespace: agent:main (gateway.multiplex_profiles is off: every key uses agent:main)",
        "rule: dm-chat",
        "flags: group_sessions_per_user=true (default), thread_sessions_per_user=false (default)",
        "canonicalisation: none",
        "scope: none (telegram supplies no scope component: the guild or workspace (scope_id) "
        "is never part of the key)",
        "shared multi-user session: no",
        "session type line: none (not shared)",
    ]
    prospective = _explain(
        tmp_path, platform="discord", chat_type="group", chat_id="c", prospective_thread_id="m"
    )
    assert "rule: thread-shared, prospective-thread" in format_explanation(prospective)
    assert f"session type line: {THREAD_LINE}" in format_explanation(prospective)
    whatsapp = _explain(tmp_path, platform="whatsapp", chat_id="999999999999999@lid")
    assert (
        "canonicalisation: DM chat id 999999999999999@lid -> 60123456789 "
        "(aliases visited: 999999999999999, 60123456789)"
    ) in format_explanation(whatsapp)


V1 = {"keys": {"schema": "v1"}}


@pytest.mark.parametrize(
    ("source", "ambiguous"),
    [
        ({"chat_type": "group", "chat_id": GROUP, "user_id": "17585"}, True),  # or a topic
        ({"chat_type": "group", "chat_id": GROUP, "thread_id": "17585"}, True),  # or a member
        ({"chat_id": "99"}, True),  # a DM chat, participant or thread
        ({"chat_id": ""}, False),  # the sink: no component to mistake
        ({"chat_type": "group", "chat_id": GROUP, "thread_id": "1", "user_id": "2"}, False),
        ({"chat_type": "group", "chat_id": "a:b", "thread_id": "1", "user_id": "2"}, True),
    ],
)
def test_v1_warns_about_ambiguous_sources(
    tmp_path: Path, source: dict[str, Any], ambiguous: bool
) -> None:
    flags = {**V1, "thread_sessions_per_user": True}
    result = _explain(tmp_path, flags, platform="telegram", **source)
    assert result["key_schema"] == {"value": "v1", "origin": "keys.schema"}
    assert bool(result["warnings"]) is ambiguous
    lines = format_explanation(result)
    assert lines[1] == "key schema: v1 (keys.schema)"
    assert any(line.startswith("warning: key schema v1 is ambiguous") for line in lines) is (
        ambiguous
    )
    assert _explain(tmp_path, platform="telegram", **source)["warnings"] == []  # v2: never
