"""``hermes-sessions explain --payload FILE --platform NAME``: the key of a raw platform event.

The samples are those of the reader tests, written from each platform's documentation (see the
docstrings of ``tests/test_readers_*.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_readers_discord as discord
import test_readers_slack as slack
import test_readers_telegram as telegram
import test_readers_whatsapp as whatsapp

from hermes_core.cli.main import main

TOPIC_KEY = f"agent:main:telegram:group:c={telegram.GROUP}:t=17585"


def _file(tmp_path: Path, payload: object) -> str:
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(payload), encoding="utf-8")
    return str(path)


def test_a_forum_topic_update_is_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = _file(tmp_path, telegram.forum_topic(telegram.ANA))
    assert main(["explain", "--payload", payload, "--platform", "telegram"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith('source: {"platform": "telegram", "chat_id": "-1002285219667"')
    assert lines[1] == f"key: {TOPIC_KEY}"
    assert "rule: thread-shared" in lines
    assert "shared multi-user session: yes" in lines


def test_json_output_carries_the_source_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = _file(tmp_path, slack.callback(thread_ts="1712345000.000100"))
    assert main(["explain", "--payload", payload, "--platform", "slack", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"]["thread_id"] == "1712345000.000100"
    assert printed["source"]["scope_id"] == slack.TEAM
    assert printed["key"] == f"agent:main:slack:group:s={slack.TEAM}:c=C1:t=1712345000.000100"
    assert printed["scope"]["component"] == slack.TEAM


def test_a_discord_guild_channel_message_is_explained_from_its_channel_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No channel cache on the command line: ``channel_type`` 0 says the channel is no thread."""
    payload = _file(tmp_path, discord.in_guild(discord.CHANNEL, channel_type=0))
    assert main(["explain", "--payload", payload, "--platform", "discord", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"]["chat_type"] == "group"
    assert printed["key"] == f"agent:main:discord:group:c={discord.CHANNEL}:u={discord.ANA['id']}"
    thread = _file(tmp_path, discord.in_guild(discord.THREAD, channel_type=11))
    assert main(["explain", "--payload", thread, "--platform", "discord"]) == 2
    assert "a thread's parent the payload does not give" in capsys.readouterr().err


def test_field_options_override_the_payload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = _file(tmp_path, whatsapp.cloud(whatsapp.text()))
    argv = ["explain", "--payload", payload, "--platform", "whatsapp", "--profile", "coder"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"]["profile"] == "coder"


@pytest.mark.parametrize(
    ("payload", "platform", "message"),
    [
        ({"update_id": 1, "edited_message": {}}, "telegram", "is not a user message"),
        ({"update_id": 1, "message": {"text": "x"}}, "telegram", "update.message.chat"),
        ([1], "telegram", "a payload must be a JSON object, not list"),
        ({}, "signal", "has no event reader"),
    ],
)
def test_unusable_payloads_are_one_line_errors(
    payload: object,
    platform: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain", "--payload", _file(tmp_path, payload), "--platform", platform]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hermes-sessions: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_payload_with_source_json_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = _file(tmp_path, telegram.private())
    argv = ["explain", "--payload", payload, "--platform", "telegram", "--source-json", payload]
    assert main(argv) == 2
    assert "leave out --source-json" in capsys.readouterr().err
