"""``rekey --forum telegram CHAT_ID``: lanes a Telegram forum's General topic had before the
reader keyed it as thread ``"1"`` move to that key with their sessions and transcripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermes_core import GatewayConfig, SessionSource, build_session_key, read_event
from hermes_core.cli.main import main
from hermes_core.domain.errors import InvalidValueError
from hermes_core.domain.keys import KeySchema
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

FORUM = "-1002285219667"
ANA = SessionSource(platform="telegram", chat_id=FORUM, chat_type="group", user_id="42")
BEN = ANA.replace(user_id="43")
TOPIC = ANA.replace(thread_id="17585")
OTHER = ANA.replace(chat_id="-4001")  # a group that is not a forum


def configure(home: Path, settings: dict[str, Any], schema: str) -> GatewayConfig:
    data = dict(settings, keys={"schema": schema})
    (home / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return GatewayConfig.load(environ={"HERMES_HOME": str(home)})


def general_update(user: int) -> dict[str, Any]:
    """A message in the forum's General topic: Chat.is_forum true, no message_thread_id nor
    is_topic_message (Telegram Bot API, "Chat" and "Message")."""
    chat = {"id": int(FORUM), "type": "supergroup", "title": "Team", "is_forum": True}
    sender = {"id": user, "is_bot": False, "first_name": "Ana"}
    message = {"message_id": 70, "date": 1735689600, "chat": chat, "from": sender, "text": "hi"}
    return {"update_id": 1, "message": message}


def rekey(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    status = main(["rekey", "--forum", "telegram", FORUM, "--json", *args])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("schema", ["v2", "v1"])
def test_thread_less_forum_lanes_move_to_the_general_topic_with_their_transcript(
    hermes_home: Path,
    settings: dict[str, Any],
    schema: KeySchema,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = configure(hermes_home, settings, schema)
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        ids = {}
        for name, source in (("ben", BEN), ("ana", ANA), ("topic", TOPIC), ("other", OTHER)):
            entry = store.get_or_create_session(source)  # Ana's lane is the newest one
            store.append_to_transcript(entry.session_id, {"role": "user", "content": name})
            ids[name] = entry.session_id
    key = {name: build_session_key(s, schema=schema) for name, s in
           (("ana", ANA), ("ben", BEN), ("topic", TOPIC), ("other", OTHER))}  # fmt: skip
    general = build_session_key(ANA.replace(thread_id="1"), schema=schema)
    assert general == (
        f"agent:main:telegram:group:c={FORUM}:t=1"
        if schema == "v2"
        else f"agent:main:telegram:group:{FORUM}:1"
    )

    status, plan = rekey("--dry-run", capsys=capsys)
    assert status == 1  # Ben's lane is left: one lane only can hold the General topic's key
    assert plan["moves"] == [{"from": key["ana"], "to": general}]
    assert [left["key"] for left in plan["left"]] == [key["ben"]]
    assert "most recently active" in plan["left"][0]["reason"]
    assert (plan["sessions"], plan["collisions"], plan["forums"]) == (
        1,
        [],
        [{"platform": "telegram", "chat_id": FORUM}],
    )

    status, done = rekey(capsys=capsys)
    assert (status, done["moves"], done["dry_run"]) == (1, plan["moves"], False)
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert store.lookup_by_session_key(key["ana"]) is None
        assert store.peek_session_id(general) == ids["ana"]
        assert store.peek_session_id(key["ben"]) == ids["ben"]
        assert store.peek_session_id(key["topic"]) == ids["topic"]
        assert store.peek_session_id(key["other"]) == ids["other"]
        assert [m["content"] for m in store.load_transcript(ids["ana"])] == ["ana"]
        # The next General-topic message, from anyone, resumes the moved session.
        plugins = fresh_plugin_manager(hermes_home)
        for user in (42, 43):
            event = read_event("telegram", general_update(user), plugins=plugins)
            assert event is not None
            assert store.get_or_create_session(event.source).session_id == ids["ana"]
    status, again = rekey(capsys=capsys)  # nothing more moves; Ben's lane is still left
    assert (status, again["moves"], again["unchanged"]) == (1, [], 3)
    assert again["left"] == [
        {"key": key["ben"], "reason": f"its new key {general} is held by another lane"}
    ]


def test_the_text_report_and_forums_that_cannot_move(
    hermes_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = configure(hermes_home, {}, "v2")
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        store.get_or_create_session(ANA)
        # Discord declares no general topic (PlatformSpec.forum_general_thread), a chat id is
        # needed, and the platform must be registered.
        for forum in (("discord", "766"), ("telegram", " ")):
            with pytest.raises(InvalidValueError, match="cannot be moved to a general topic"):
                store.rekey(dry_run=True, forums=[forum])
        with pytest.raises(InvalidValueError, match="pager"):
            store.rekey(dry_run=True, forums=[("pager", "1")])
    assert main(["rekey", "--forum", "telegram", FORUM, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{build_session_key(ANA)} -> agent:main:telegram:group:c={FORUM}:t=1" in out
    assert (
        "would move 1 lanes, 1 session rows, 0 queued events and 0 restart counts of "
        f"telegram {FORUM} to the general topic" in out
    )
    # One change at a time: a usage error.
    assert main(["rekey", "--to", "v2", "--forum", "telegram", FORUM]) == 2
    assert "not allowed with argument --to" in capsys.readouterr().err
