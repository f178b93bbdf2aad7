"""The command line behaves alike across commands: options after the command, one error prefix,
advice for the command line, one time format in ``--json``, the log options, one ``--json``
shape per family of commands."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from support.populate import State, config_for, run

from conftest import builtins_only
from hermes_core.cli.main import main
from hermes_core.store import SessionStore


def _script(*argv: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("hermes-sessions")
    return subprocess.run(
        [str(script), *argv], capture_output=True, text=True, check=False, timeout=120,
        env=builtins_only(PYTHONIOENCODING="utf-8"),
    )  # fmt: skip


def test_global_options_work_after_every_command(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, _ = state
    (home / "config.yaml").write_text("gateway:\n  multiplex_profiles: true\n")
    where = ["--state-dir", str(home)]
    code, out, err = run(capsys, "plugins", "--json", *where)
    assert (code, err) == (0, "")
    assert "telegram" in [plugin["name"] for plugin in json.loads(out)]
    source = ["--platform", "telegram", "--chat-id", "9", "--profile", "main"]
    code, out, _ = run(capsys, "key", *source, *where)  # the directory's config.yaml is read
    assert (code, out) == (0, "agent:main~:telegram:dm:c=9\n")
    code, out, _ = run(capsys, "explain", *source, "--json", *where, "--debug")
    assert code == 0
    assert json.loads(out)["key"] == "agent:main~:telegram:dm:c=9"
    code, out, _ = run(capsys, "rekey", "--to", "v2", "--dry-run", *where)
    assert (code, out) == (0, "the store already uses key schema v2; nothing to do\n")


@pytest.mark.parametrize(
    "argv",
    [["rekey", "--dry-run"], ["nosuch"], ["ls", "--sort", "size"], ["key", "--chat-id", "1"]],
)
def test_usage_errors_end_in_the_one_error_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("usage: hermes-sessions")
    assert err.splitlines()[-1].startswith("hermes-sessions: error: ")


def _is_iso(value: object) -> bool:
    return isinstance(value, str) and datetime.fromisoformat(value).utcoffset() is not None


def test_json_times_are_iso_strings_in_ls_show_search_and_export(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    where = ["--state-dir", str(home)]
    _, out, _ = run(capsys, "ls", "--json", *where)
    lanes = json.loads(out)
    assert all(_is_iso(lane["updated_at"]) and _is_iso(lane["created_at"]) for lane in lanes)
    _, out, _ = run(capsys, "show", keys["alice"], "--json", *where)
    details = json.loads(out)
    assert _is_iso(details["entry"]["created_at"])
    assert details["transcript"]
    assert all(_is_iso(message["timestamp"]) for message in details["transcript"])
    assert all(_is_iso(letter["dead_at"]) for letter in details["dead_letters"])
    assert all(_is_iso(owed["created_at"]) for owed in details["owed_replies"])
    _, out, _ = run(capsys, "search", "zebra", "--json", *where)
    assert all(_is_iso(hit["timestamp"]) for hit in json.loads(out))
    _, out, _ = run(capsys, "export", *where)
    times = [
        value
        for line in out.splitlines()
        for name, value in json.loads(line)["row"].items()
        if (name == "timestamp" or name.endswith("_at")) and value is not None
    ]
    assert len(times) > 20
    assert all(_is_iso(value) for value in times), times
    code, out, _ = run(capsys, "show", keys["alice"], *where)  # tables: to the second
    assert code == 0
    assert "  [20" in out
    assert "Z] user: hello from alice" in out


@pytest.mark.slow
def test_log_options_choose_the_level_and_lines_carry_it(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"source": {"platform": "telegram", "chat_id": "7"}, "text": "hi"}\n')
    where = ["--state-dir", str(tmp_path / "home")]
    quiet = _script("replay", str(events), *where)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""  # warnings and errors only by default
    verbose = _script("replay", str(events), *where, "-v")
    lines = verbose.stderr.splitlines()
    assert lines
    assert all(line.startswith("INFO hermes_") for line in lines), lines
    debug = _script("--log-level", "DEBUG", "replay", str(events), *where)
    assert any(line.startswith("DEBUG ") for line in debug.stderr.splitlines())
    assert _script("replay", str(events), *where, "-vv", "--log-level", "error").stderr == ""
    assert _script("-vv", "replay", str(events), *where, "--quiet").stderr == ""


def test_suspend_and_resume_report_one_shape(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    where = ["--state-dir", str(home), "--json"]
    reports = [
        json.loads(run(capsys, command, keys["alice"], *where)[1])
        for command in ("suspend", "suspend", "resume", "resume")
    ]
    assert [(report["suspended"], report["changed"]) for report in reports] == [
        (True, True), (True, False), (False, True), (False, False),
    ]  # fmt: skip
    assert all(list(report) == ["session_key", "suspended", "changed"] for report in reports)
    code, out, _ = run(capsys, "suspend", keys["bob"], "--state-dir", str(home))
    assert (code, out) == (0, f"{keys['bob']}: was already suspended\n")


def test_search_limit_outside_its_range_is_refused(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, _ = state
    for limit in ("0", "101"):
        code, out, err = run(capsys, "search", "zebra", "--limit", limit, "--state-dir", str(home))
        assert (code, out) == (2, "")
        assert err == "hermes-sessions: error: --limit must be from 1 to 100.\n"
    code, out, _ = run(capsys, "search", "zebra", "--limit", "100", "--state-dir", str(home))
    assert code == 0
    assert out.count("zebra") == 6


def test_ls_of_an_unknown_platform_is_an_error_like_key(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, _ = state
    code, out, err = run(capsys, "ls", "--platform", "nope", "--state-dir", str(home))
    assert (code, out) == (2, "")
    assert err.startswith("hermes-sessions: error: --platform 'nope' is not a registered platform")
    assert err.count("\n") == 1
    code, out, _ = run(capsys, "ls", "--platform", "slack", "--state-dir", str(home))
    assert (code, out) == (0, "no lanes\n")  # a registered platform without lanes


def test_recover_without_dry_run_says_what_to_run(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, _ = state
    code, out, err = run(capsys, "recover", "--state-dir", str(home))
    assert (code, out) == (2, "")
    assert err == (
        "hermes-sessions: error: recovery runs when a gateway starts, so `recover` only shows "
        "what the next start-up would recover: run `hermes-sessions recover --dry-run`, or start "
        "the gateway to recover.\n"
    )


def test_console_commands_without_their_arguments_print_their_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(":chat\n:as\n:platform\n:quit\n"))
    code = main(["chat", "--platform", "telegram", "--chat-id", "42", "--state-dir",
                 str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    assert err.splitlines() == [
        f"hermes-sessions: error: usage: {usage} (:help says what it does); nothing changed."
        for usage in (":chat ID [TYPE]", ":as USER [NAME]", ":platform NAME")
    ]


def test_prune_and_its_dry_run_report_one_shape(
    state: State, capsys: pytest.CaptureFixture[str]
) -> None:
    home, keys = state
    with SessionStore.open(config_for(home)) as store:  # age alice's lane by decades
        entry = store.lookup_by_session_key(keys["alice"])
        assert entry is not None
        store._backing.backend.put_route(  # a direct routing write: the only way to go back in time
            entry.model_copy(update={"updated_at": entry.updated_at.replace(year=2000)}).to_dict()
        )
    where = ["--days", "1", "--state-dir", str(home), "--json"]
    planned = json.loads(run(capsys, "prune", "--dry-run", *where)[1])
    done = json.loads(run(capsys, "prune", *where)[1])
    assert planned == {"lanes": [keys["alice"]], "count": 1, "dry_run": True}
    assert done == {"lanes": [keys["alice"]], "count": 1, "dry_run": False}


def test_version_loads_no_command_and_no_heavy_dependency() -> None:
    probe = (
        "import sys\n"
        "from hermes_core.cli.main import main\n"
        "assert main(['--debug', '--config', 'none.yaml', '--version']) == 0\n"
        "heavy = ('pydantic', 'sqlalchemy', 'yaml', 'pluggy', 'hermes_core.config.schema',\n"
        "         'hermes_core.store', 'hermes_core.cli.common')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.splitlines()[-1] == "[]"
    assert result.stdout.startswith("hermes-sessions ")
