"""``chat`` and ``replay`` through ``hermes_core.cli.main`` (and the console script) with the
real gateway on a state directory: keys, session ids, replies, persistence, the console
commands, bad lines and a held state directory."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.populate import config_for

from conftest import builtins_only
from hermes_core import EchoAgent, Gateway, InMemoryAdapter, SessionStore, create_plugin_manager
from hermes_core.cli.main import main
from hermes_core.gateway.texts import NEW_SESSION

TURN = re.compile(r"^  key (\S+)  session (\S+)$", re.MULTILINE)
GROUP = ["--platform", "telegram", "--chat-id", "-100", "--chat-type", "group"]


def chat(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, lines: str, *argv: str
) -> tuple[int, str, str]:
    """Run ``chat`` with ``lines`` on standard input."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code = main(["chat", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def turns(out: str) -> list[tuple[str, str]]:
    """(key, session id) printed after each message."""
    return TURN.findall(out)


def test_two_senders_in_a_group_get_their_own_lanes_and_share_a_thread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = str(tmp_path / "state")  # created by chat
    script = "from alice\n:as bob Bob\nfrom bob\n:thread 17\nin the topic\n:as alice\nme too\n"
    code, out, err = chat(capsys, monkeypatch, script, *GROUP, "--user-id", "alice",
                          "--state-dir", state)  # fmt: skip
    assert code == 0, err
    assert err == ""
    alice, bob, topic = (
        "agent:main:telegram:group:c=-100:u=alice",
        "agent:main:telegram:group:c=-100:u=bob",
        "agent:main:telegram:group:c=-100:t=17",
    )
    lanes = turns(out)
    assert [key for key, _ in lanes] == [alice, bob, topic, topic]
    assert lanes[0][1] != lanes[1][1]  # per-user sessions in the group
    assert lanes[2][1] == lanes[3][1]  # one shared session in the thread
    assert "alice> from alice\n  → telegram:-100: echo: from alice\n" in out
    assert "Bob> from bob\n  → telegram:-100: echo: from bob\n" in out
    assert "  → telegram:-100/17: echo: [Bob] in the topic\n" in out  # shared: sender-prefixed
    assert "  → telegram:-100/17: echo: [alice] me too\n" in out
    assert f"telegram group -100 thread 17 as Bob: {topic}\n" in out
    assert out.endswith("gateway stopped\n")


def test_new_starts_a_session_and_a_second_chat_continues_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    dm = ["--platform", "telegram", "--chat-id", "42", "--user-id", "alice", "--state-dir",
          str(state)]  # fmt: skip
    code, out, _ = chat(capsys, monkeypatch, "hello\n/new\nafter new\n", *dm)
    assert code == 0
    (key, first), (_, renewed), (_, after) = turns(out)
    assert key == "agent:main:telegram:dm:c=42"
    assert renewed != first
    assert after == renewed
    assert f"  → telegram:42: {NEW_SESSION}\n" in out

    code, out, _ = chat(capsys, monkeypatch, "still there?\n", *dm)
    assert code == 0
    assert turns(out) == [(key, renewed)]
    with SessionStore.open(config_for(state), read_only=True) as store:
        contents = [m["content"] for m in store.load_transcript(renewed)]
    assert contents == ["after new", "echo: after new", "still there?", "echo: still there?"]


def test_quit_stops_and_console_mistakes_are_reported_without_stopping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = ":chat 43 banana\n:bogus\n:platform nosuch\n:)\n:quit\nnever sent\n"
    code, out, err = chat(capsys, monkeypatch, script, "--platform", "telegram", "--chat-id",
                          "42", "--state-dir", str(tmp_path))  # fmt: skip
    assert code == 0
    errors = err.splitlines()
    assert len(errors) == 3
    assert all(line.startswith("hermes-sessions: error: ") for line in errors)  # one prefix
    assert ":chat 'banana' is not a chat type" in errors[0]
    assert ":bogus is not a console command" in errors[1]
    assert "platform 'nosuch' is not a registered platform" in errors[2]
    assert "  → telegram:42: echo: :)\n" in out  # not a console command: a message
    assert "never sent" not in out
    assert len(turns(out)) == 1


def test_an_agent_named_by_import_path_is_built_from_the_lane_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--platform", "slack", "--chat-id", "C1", "--state-dir", str(tmp_path)]
    code, out, _ = chat(capsys, monkeypatch, "ping\n", *argv, "--agent", "support.agents:LaneAgent")
    assert code == 0
    ((key, _),) = turns(out)
    assert f"  → slack:C1: {key} heard ping\n" in out
    for spec, why in (
        ("support.agents", "no agent of that name in the entry point group hermes.agents"),
        ("support.nowhere:X", "importing 'support.nowhere' failed"),
        ("support.agents:Missing", "has no attribute 'Missing'"),
        ("support.agents:no_entry", "takes 0 required arguments"),
    ):
        code, out, err = chat(capsys, monkeypatch, "ping\n", *argv, "--agent", spec)
        assert code == 2
        assert err.count("\n") == 1
        assert why in err
        assert out == ""


def test_chat_takes_the_configured_agent_and_options_unless_the_flag_names_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("agent:\n  use: support.agents:greeters\n  options: {greeting: ahoy}\n")
    argv = ["--config", str(path), "--platform", "slack", "--chat-id", "C1",
            "--state-dir", str(tmp_path / "state")]  # fmt: skip
    code, out, _ = chat(capsys, monkeypatch, "ping\n", *argv)
    assert code == 0
    assert "  → slack:C1: ahoy, ping\n" in out
    code, out, _ = chat(capsys, monkeypatch, "pong\n", *argv, "--agent", "echo")
    assert code == 0
    assert "  → slack:C1: echo: pong\n" in out
    path.write_text("agent:\n  use: openai\n  options: {model: m, api_key_env: NO_SUCH_KEY}\n")
    code, out, err = chat(capsys, monkeypatch, "ping\n", *argv)
    assert code == 2
    assert "agent.options.api_key_env names NO_SUCH_KEY, which is not set" in err
    assert out == ""


def test_chat_is_refused_in_one_line_while_a_gateway_holds_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_for(tmp_path)
    running = Gateway(config, create_plugin_manager(config), lambda entry: EchoAgent(),
                      [InMemoryAdapter("telegram")])  # fmt: skip
    loop = asyncio.new_event_loop()
    loop.run_until_complete(running.start())
    try:
        code, out, err = chat(capsys, monkeypatch, "hello\n", "--platform", "telegram",
                              "--chat-id", "42", "--state-dir", str(tmp_path))  # fmt: skip
        replay = tmp_path / "events.jsonl"
        replay.write_text("")
        replay_code = main(["replay", str(replay), "--state-dir", str(tmp_path)])
        replay_err = capsys.readouterr().err
    finally:
        loop.run_until_complete(running.stop())
        loop.close()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"hermes-sessions: error: another gateway (pid {os.getpid()})")
    assert replay_code == 2
    assert replay_err == err


def event(platform: str, chat_id: str, text: str, **source: str) -> str:
    data = {"source": {"platform": platform, "chat_id": chat_id, **source}, "text": text}
    return json.dumps(data)


def test_replay_feeds_good_lines_in_order_and_skips_bad_ones_by_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join([
        event("telegram", "7", "hello", user_id="7", user_name="Ana"),
        '{"source": {"platform": "telegram", "chat_id": "7"}, "text": "cut off',
        event("nosuch", "7", "lost"),
        "",
        event("discord", "55", "in a thread", chat_type="group", thread_id="9", user_id="3"),
        event("telegram", "7", "/new", user_id="7", user_name="Ana"),
    ]) + "\n")  # fmt: skip
    state = tmp_path / "state"
    code = main(["replay", str(events), "--state-dir", str(state)])
    out, err = capsys.readouterr()
    assert code == 1
    corrupt, unknown = err.splitlines()
    assert corrupt == (
        f"hermes-sessions: error: {events}:2: skipped: not JSON (Unterminated string starting at: "
        "line 1 column 62 (char 61))"
    )
    assert unknown.startswith(
        f"hermes-sessions: error: {events}:3: skipped: platform 'nosuch' is not a registered "
        "platform "
    )
    assert [line for line in out.splitlines() if line.startswith("line ")] == [
        "line 1: Ana> hello", "line 5: 3> in a thread", "line 6: Ana> /new",
    ]  # fmt: skip
    assert "line 1: Ana> hello\n  → telegram:7: echo: hello\n" in out
    assert "  → discord:55/9: echo: [3] in a thread\n" in out
    assert f"line 6: Ana> /new\n  → telegram:7: {NEW_SESSION}\n" in out
    (dm, first), (topic, _), (dm_again, renewed) = turns(out)
    assert (dm, topic, dm_again) == (
        "agent:main:telegram:dm:c=7", "agent:main:discord:group:c=55:t=9", dm
    )  # fmt: skip
    assert renewed != first
    assert "replayed 3 event(s), skipped 2 line(s)\n" in out

    events.write_text(event("telegram", "8", "all good") + "\n")
    assert main(["replay", str(events), "--state-dir", str(state)]) == 0
    assert "  → telegram:8: echo: all good\n" in capsys.readouterr().out
    assert main(["replay", str(tmp_path / "none.jsonl"), "--state-dir", str(state)]) == 2
    assert "cannot read it (No such file or directory)" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_chats_with_an_agent_from_the_current_directory(tmp_path: Path) -> None:
    (tmp_path / "shouting.py").write_text(
        "from hermes_core import Agent\n\n"
        "class Shout(Agent):\n"
        "    def __init__(self, entry):\n"
        "        self.entry = entry\n\n"
        "    async def run_turn(self, request):\n"
        "        return request.message.upper()\n"
    )  # fmt: skip
    script = Path(sys.executable).with_name("hermes-sessions")
    result = subprocess.run(
        [str(script), "chat", "--platform", "telegram", "--chat-id", "5", "--agent",
         "shouting:Shout", "--state-dir", str(tmp_path / "state")],
        input="hello\n", capture_output=True, text=True, check=False, cwd=tmp_path,
        env=builtins_only(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "operator> hello\n  → telegram:5: HELLO\n" in result.stdout
    assert turns(result.stdout)[0][0] == "agent:main:telegram:dm:c=5"
