"""The operator commands through ``hermes_core.cli.main`` (and the console script) on a real
state directory: outputs, ``--json`` shapes, exit codes and one-line errors."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.populate import State, config_for, run
from support.terminal import Terminal

from conftest import builtins_only
from hermes_core.cli.main import main
from hermes_core.store import SessionStore


def test_ls_lists_lanes_with_flags_filters_and_json(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    code, out, _ = run(capsys, "ls", "--state-dir", str(home))
    assert code == 0
    assert out.splitlines()[0].split() == ["KEY", "SESSION", "UPDATED", "MESSAGES", "FLAGS"]
    assert len(out.splitlines()) == 4
    bob = next(line for line in out.splitlines() if line.startswith(keys["bob"]))
    assert bob.endswith("suspended")
    code, out, _ = run(capsys, "--state-dir", str(home), "ls", "--json", "--suspended")
    lanes = json.loads(out)
    assert [lane["session_key"] for lane in lanes] == [keys["bob"]]
    assert lanes[0]["message_count"] == 4
    assert lanes[0]["suspended"] is True
    code, out, _ = run(capsys, "ls", "--state-dir", str(home), "--json", "--dead-lettered")
    assert [lane["session_key"] for lane in json.loads(out)] == [keys["alice"]]
    code, out, _ = run(capsys, "ls", "--state-dir", str(home), "--json", "--platform", "discord")
    assert [lane["session_key"] for lane in json.loads(out)] == [keys["topic"]]
    code, out, _ = run(capsys, "ls", "--state-dir", str(home), "--json", "--sort", "key",
                       "--limit", "2")  # fmt: skip
    assert [lane["session_key"] for lane in json.loads(out)] == sorted(keys.values())[:2]


def test_show_prints_entry_queue_dead_letters_owed_replies_and_transcript(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    code, out, _ = run(capsys, "show", keys["alice"], "--state-dir", str(home), "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["entry"]["session_key"] == keys["alice"]
    assert next(m["content"] for m in shown["transcript"]) == "hello from alice"
    assert shown["dead_letters"][0]["last_error"] == "agent exploded"
    assert [row["content"] for row in shown["owed_replies"]] == ["a reply owed"]
    session_id = shown["entry"]["session_id"]
    code, out, _ = run(capsys, "show", session_id, "--state-dir", str(home))
    assert f"key:      {keys['alice']}" in out
    assert "owed replies: 1" in out
    code, out, _ = run(capsys, "show", keys["topic"], "--state-dir", str(home))
    assert "queued:   1 event(s)" in out
    assert "queued later" in out


def test_search_finds_messages(state: State, capsys: pytest.CaptureFixture[str]) -> None:
    home, _ = state
    code, out, _ = run(capsys, "search", "zebra", "--state-dir", str(home), "--json")
    hits = json.loads(out)
    assert code == 0
    assert len(hits) == 6
    assert set(hits[0]) == {"session_id", "message_id", "role", "timestamp", "snippet"}
    code, out, _ = run(capsys, "search", "nothing-like-it", "--state-dir", str(home))
    assert out == "no matches\n"


def test_unknown_lane_and_bad_state_dir_are_one_line_errors(
    state: State, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home, _ = state
    code, out, err = run(capsys, "show", "agent:main:nope", "--state-dir", str(home))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert "no lane has the session key" in err
    code, _, err = run(capsys, "ls", "--state-dir", str(tmp_path / "missing"))
    assert code == 2
    assert "no such state directory" in err
    assert err.count("\n") == 1
    code, _, err = run(capsys, "ls", "--url", "nonsense")
    assert code == 2
    assert "is not a store URL" in err


def test_lane_commands_change_flags_and_sessions(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    args = ["--state-dir", str(home)]
    code, out, _ = run(capsys, "resume", keys["bob"], *args)
    assert code == 0
    assert out == f"{keys['bob']}: no longer suspended\n"
    code, out, _ = run(capsys, "suspend", keys["alice"], *args, "--json")
    assert json.loads(out) == {"session_key": keys["alice"], "suspended": True, "changed": True}
    code, out, _ = run(capsys, "reset", keys["topic"], *args, "--json")
    reset = json.loads(out)
    assert reset["ended"] != reset["session_id"]
    with SessionStore.open(config_for(home), read_only=True) as store:
        bob = store.lookup_by_session_key(keys["bob"])
        alice = store.lookup_by_session_key(keys["alice"])
        topic = store.lookup_by_session_key(keys["topic"])
        assert bob is not None
        assert not bob.suspended
        assert alice is not None
        assert alice.suspended
        assert topic is not None
        assert topic.session_id == reset["session_id"]


def test_requeue_and_drop_dead_letters(state: State, capsys: pytest.CaptureFixture[str]) -> None:
    home, _ = state
    args = ["--state-dir", str(home)]
    with SessionStore.open(config_for(home), read_only=True) as store:
        [letter] = store.dead_letters()
    code, _, err = run(capsys, "drop", "999", *args)
    assert code == 2
    assert "no dead-lettered event has the id 999" in err
    code, out, _ = run(capsys, "requeue", str(letter.event_id), *args)
    assert code == 0
    assert out == "requeued 1 event(s)\n"
    with SessionStore.open(config_for(home), read_only=True) as store:
        assert store.dead_letters() == []
        assert "poison" in [event.text for _, _, event in store._queue.restore()]
        store.close()
    with SessionStore.open(config_for(home)) as store:
        for _ in range(3):
            store._queue.fail(letter.event_id, "again")
    code, out, _ = run(capsys, "drop", "--all", *args, "--json")
    assert json.loads(out) == {"dropped": [letter.event_id]}
    with SessionStore.open(config_for(home), read_only=True) as store:
        assert store.dead_letters() == []
        assert "poison" not in [event.text for _, _, event in store._queue.restore()]


def test_writing_commands_refuse_a_held_store_and_reading_ones_work(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    with SessionStore.open(config_for(home)):  # a gateway's writable store
        code, _, err = run(capsys, "suspend", keys["alice"], "--state-dir", str(home))
        assert code == 2
        assert err.count("\n") == 1
        assert err.startswith("hermes-sessions: error: another writer (pid ")
        assert "holds the store" in err
        assert "SessionStore" not in err  # advice for the command line, not for the library
        assert "read_only" not in err
        code, out, _ = run(capsys, "ls", "--state-dir", str(home), "--json")
        assert code == 0
        assert len(json.loads(out)) == 3
        code, _, err = run(capsys, "--debug", "reset", keys["alice"], "--state-dir", str(home))
        assert code == 2
        assert "Traceback" in err


def test_prune_dry_run_then_prune(state: State, capsys: pytest.CaptureFixture[str]) -> None:
    home, keys = state
    args = ["--state-dir", str(home)]
    code, out, _ = run(capsys, "prune", "--days", "1", "--dry-run", *args, "--json")
    assert json.loads(out) == {"lanes": [], "count": 0, "dry_run": True}
    with SessionStore.open(config_for(home)) as store:  # age alice's lane by 10 days
        entry = store.lookup_by_session_key(keys["alice"])
        assert entry is not None
        store._backing.backend.put_route(  # a direct routing write: the only way to go back in time
            entry.model_copy(update={"updated_at": entry.updated_at.replace(year=2000)}).to_dict()
        )
    code, out, _ = run(capsys, "prune", "--days", "1", "--dry-run", *args, "--json")
    assert json.loads(out) == {"lanes": [keys["alice"]], "count": 1, "dry_run": True}
    code, out, _ = run(capsys, "prune", "--days", "1", *args)
    assert code == 0
    assert out == f"{keys['alice']}\nremoved 1 lane(s)\n"
    _, out, _ = run(capsys, "ls", *args, "--json")
    assert keys["alice"] not in [lane["session_key"] for lane in json.loads(out)]


def test_import_sessions_json_adds_missing_lanes(
    state: State, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home, keys = state
    mirror = home / "sessions" / "sessions.json"
    saved = tmp_path / "saved.json"
    saved.write_bytes(mirror.read_bytes())
    assert keys["bob"] in json.loads(saved.read_text())
    with sqlite3.connect(home / "state.db") as conn:  # the lane's route is lost
        conn.execute("DELETE FROM gateway_routing WHERE session_key = ?", (keys["bob"],))
    code, out, _ = run(capsys, "import-sessions-json", str(saved), "--state-dir", str(home))
    assert code == 0
    assert out == "imported 1 lane(s)\n"
    code, _, err = run(capsys, "import-sessions-json", str(tmp_path / "no.json"),
                       "--state-dir", str(home))  # fmt: skip
    assert code == 2
    assert "no such file" in err


def test_import_sessions_json_shows_progress_on_a_terminal_and_none_with_json(
    state: State, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    home, _ = state
    mirror = home / "sessions" / "sessions.json"
    for extra, drawn in (((), True), (("--json",), False)):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["import-sessions-json", str(mirror), "--state-dir", str(home), *extra]) == 0
        shown = terminal.getvalue()
        assert ("import-sessions-json: reading [" in shown) is drawn
        assert ("] 3/3\n" in shown) is drawn  # the file's three entries, each read
        assert ("import-sessions-json: writing [" in shown) is drawn
    assert json.loads(capsys.readouterr().out.split("imported 0 lane(s)\n")[-1]) == {"imported": 0}


def test_recover_dry_run_reports_what_start_up_would_do(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    with SessionStore.open(config_for(home)) as store:
        store.mark_turn_active(keys["topic"])  # a turn a crash left behind
    code, out, _ = run(capsys, "recover", "--dry-run", "--state-dir", str(home), "--json")
    plan = json.loads(out)
    assert code == 0
    assert plan["last_stop_clean"] is False
    assert plan["resume"] == [keys["topic"]]
    assert [row["content"] for row in plan["resend"]] == ["a reply owed"]
    assert plan["queued_events"] == 1
    code, out, _ = run(capsys, "recover", "--dry-run", "--state-dir", str(home))
    assert f"resume: {keys['topic']}" in out
    assert "last stop: unclean" in out
    with SessionStore.open(config_for(home), read_only=True) as store:  # nothing written
        topic = store.lookup_by_session_key(keys["topic"])
        assert topic is not None
        assert topic.active_turn_token is not None
    assert run(capsys, "recover", "--state-dir", str(home))[0] == 2  # --dry-run is required


def test_export_jsonl_and_markdown(
    state: State, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    home, keys = state
    code, out, _ = run(capsys, "export", "--state-dir", str(home))
    records = [json.loads(line) for line in out.splitlines()]
    tables = {record["table"] for record in records}
    assert code == 0
    assert tables == {
        "sessions",
        "messages",
        "gateway_routing",
        "queued_events",
        "delivery_obligations",
    }
    assert sum(record["table"] == "messages" for record in records) == 12
    target = tmp_path / "out.md"
    code, _, _ = run(capsys, "export", "--format", "markdown", "-o", str(target),
                     "--state-dir", str(home))  # fmt: skip
    text = target.read_text()
    assert f"## {keys['alice']}" in text
    assert "**user**" in text
    assert "hello from bob" in text


@pytest.mark.slow
def test_console_script_runs_ls_in_a_subprocess(state: State) -> None:
    home, keys = state
    script = Path(sys.executable).with_name("hermes-sessions")
    result = subprocess.run(
        [str(script), "ls", "--json", "--state-dir", str(home)],
        capture_output=True, text=True, check=False, env=builtins_only(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(lane["session_key"] for lane in json.loads(result.stdout)) == sorted(
        keys.values()
    )
    assert result.stderr == ""  # no progress bar or noise when not on a terminal


@pytest.mark.parametrize("chat_type", ["GROUP", "banana"])
def test_key_refuses_an_unknown_chat_type(
    chat_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["key", "--platform", "telegram", "--chat-id", "1", "--chat-type", chat_type])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert f"--chat-type {chat_type!r} is not a chat type" in err


def test_config_is_accepted_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("gateway:\n  multiplex_profiles: false\n")
    assert main(["key", "--platform", "telegram", "--chat-id", "9", "--config", str(config)]) == 0
    assert capsys.readouterr().out == "agent:main:telegram:dm:c=9\n"
    assert main(["key", "--platform", "telegram", "--config", str(tmp_path / "none.yaml")]) == 2


def test_demo_on_a_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    assert main(["demo", "--state-dir", str(afile)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot be used as the demo's state directory" in err
