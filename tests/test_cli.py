"""The hermes-sessions console script: version, plugins, key, explain and error reporting."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hermes_core
from conftest import builtins_only
from hermes_core.cli.explain import explain_session_key
from hermes_core.cli.main import main
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import SessionSource
from hermes_core.plugins.manager import create_plugin_manager

BUILTINS = ["platforms", "telegram", "discord", "slack", "whatsapp"]
CONNECTING = {"telegram", "discord", "slack", "whatsapp"}
"""The built-in platform plugins that also provide a connector."""
GROUP = "-1002285219667"
README_EXAMPLE = [
    "--platform", "telegram", "--chat-type", "group", "--chat-id", GROUP, "--user-id", "alice",
    "--thread-id", "17585",
]  # fmt: skip
_ENV_TO_CLEAR = ("HERMES_DISABLE_PLUGINS", "HERMES_PLUGINS_AUTOLOAD", "GATEWAY_MULTIPLEX_PROFILES")


@pytest.fixture(autouse=True)
def hermes_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path))
    for name in _ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single stderr line of a failed command (nothing on stdout)."""
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hermes-sessions: error: ")
    return lines[0]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hermes-sessions {hermes_core.__version__ or 'unknown'}\n"


def test_plugins_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "DISTRIBUTION", "VERSION", "PROVIDES"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    for name in BUILTINS:
        assert rows[name][1:3] == ["loaded", "hermes-sessions"]
        assert rows[name][4] == "platforms:"
    assert rows["telegram"][5:] == ["telegram;", "connectors:", "telegram"]
    assert rows["eviction"][4:] == ["policy:", "lru"]
    assert "Problems:" not in lines


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    plugins = json.loads(capsys.readouterr().out)
    assert [plugin["name"] for plugin in plugins][: len(BUILTINS)] == BUILTINS
    for plugin in plugins[: len(BUILTINS)]:
        assert list(plugin) == [
            "name", "status", "distribution", "version", "builtin", "hooks", "provides",
            "problems", "replaced",
        ]  # fmt: skip
        assert plugin["status"] == "loaded"
        assert plugin["distribution"] == "hermes-sessions"
        assert plugin["builtin"] is True
        connector = ["hermes_register_connectors"] if plugin["name"] in CONNECTING else []
        assert plugin["hooks"] == [*connector, "hermes_register_platforms"]
        assert plugin["problems"] == []
    steps = next(plugin for plugin in plugins if plugin["name"] == "recovery_steps")
    assert steps["provides"] == {
        "platforms": [], "schemes": [], "policy": None, "connectors": [],
        "steps": [
            "jsonl_backlog_replay", "fts_rebuild_if_stale", "clean_shutdown", "stuck_loop",
            "queue_restore",
        ],
    }  # fmt: skip


@pytest.mark.parametrize("chat_id", [["--chat-id", GROUP], [f"--chat-id={GROUP}"]])
def test_key_with_negative_chat_id(capsys: pytest.CaptureFixture[str], chat_id: list[str]) -> None:
    argv = ["key", "--platform", "telegram", "--chat-type", "group", *chat_id, "--user-id", "alice"]
    assert main(argv) == 0
    assert capsys.readouterr().out == f"agent:main:telegram:group:c={GROUP}:u=alice\n"


def test_key_chat_id_defaults_to_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--platform", "telegram", "--user-id", "jordan"]) == 0
    assert capsys.readouterr().out == "agent:main:telegram:dm:u=jordan\n"


def test_explain_json_equals_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", *README_EXAMPLE, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    source = SessionSource(
        platform="telegram", chat_type="group", chat_id=GROUP, user_id="alice", thread_id="17585"
    )
    config = GatewayConfig.load()
    assert printed == explain_session_key(source, config, create_plugin_manager(config))
    assert printed["key"] == f"agent:main:telegram:group:c={GROUP}:t=17585"


def test_explain_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--platform", "telegram", "--chat-id", "99"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "key: agent:main:telegram:dm:c=99"
    assert "rule: dm-chat" in lines
    assert (
        "flags: group_sessions_per_user=true (default), thread_sessions_per_user=false (default)"
    ) in lines
    assert "shared multi-user session: no" in lines


def test_config_yaml_in_hermes_home_is_used(
    hermes_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (hermes_home / "config.yaml").write_text("gateway:\n  multiplex_profiles: true\n")
    assert main(["key", "--platform", "telegram", "--chat-id", "99", "--profile", "main"]) == 0
    assert capsys.readouterr().out == "agent:main~:telegram:dm:c=99\n"


def test_config_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.yaml"
    path.write_text("group_sessions_per_user: false\n")
    argv = ["--config", str(path), "explain", "--platform", "telegram", "--chat-type", "group"]
    assert main([*argv, "--chat-id", GROUP, "--user-id", "alice", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["key"] == f"agent:main:telegram:group:c={GROUP}"
    assert result["flags"]["group_sessions_per_user"] == {"value": False, "origin": "top level"}


def test_source_json_file_with_an_overriding_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "source.json"
    source = {"platform": "telegram", "chat_type": "group", "chat_id": -1002285219667}
    path.write_text(json.dumps({**source, "user_id": "alice"}))
    assert main(["key", "--source-json", str(path), "--user-id", "bob"]) == 0
    assert capsys.readouterr().out == f"agent:main:telegram:group:c={GROUP}:u=bob\n"


def test_source_json_from_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"platform": "slack", "chat_id": "D1"}'))
    assert main(["key", "--source-json", "-"]) == 0
    assert capsys.readouterr().out == "agent:main:slack:dm:c=D1\n"


def test_unknown_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--platform", "nosuch", "--chat-id", "1"]) == 2
    assert "'nosuch'" in _error_line(capsys)


def test_bad_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("group_sessions_per_user: [\n")
    assert main(["--config", str(path), "key", "--platform", "telegram"]) == 2
    assert str(path) in _error_line(capsys)


def test_bad_config_value_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("group_sessions_per_user: maybe\n")
    assert main(["--config", str(path), "plugins"]) == 2
    line = _error_line(capsys)
    assert str(path) in line
    assert "group_sessions_per_user" in line


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "cannot read the file"), ("{not json", "not valid JSON"), ("[1]", "JSON object")],
)
def test_bad_source_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str
) -> None:
    path = tmp_path / "source.json"
    if content is not None:
        path.write_text(content)
    assert main(["explain", "--source-json", str(path)]) == 2
    line = _error_line(capsys)
    assert str(path) in line
    assert expected in line


def test_debug_prints_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--debug", "key", "--platform", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith("hermes-sessions: error: platform 'nosuch'")


def test_platform_required_without_source_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--chat-id", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hermes-sessions key")
    assert "--platform is required unless --source-json is given" in err


def test_console_script_explains_the_readme_example(hermes_home: Path) -> None:
    script = Path(sys.executable).parent / "hermes-sessions"
    if not script.exists():
        pytest.skip(f"console script not installed beside the interpreter: {script}")
    env = {k: v for k, v in os.environ.items() if k not in _ENV_TO_CLEAR}
    env = builtins_only(env, HERMES_HOME=str(hermes_home), PYTHONIOENCODING="utf-8")
    result = subprocess.run(
        [str(script), "explain", *README_EXAMPLE],
        capture_output=True, text=True, encoding="utf-8", env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"key: agent:main:telegram:group:c={GROUP}:t=17585" in result.stdout.splitlines()
