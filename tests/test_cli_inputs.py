"""Files and values an operator hands the command line that it cannot use: each is one error line
and exit 2 (or, in ``replay``, a skipped line with its number), never a traceback, a hang or an
unbounded read."""

from __future__ import annotations

import io
import json
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.populate import populate

from conftest import FakeDistribution
from hermes_core.cli.console import MAX_EVENT_LINE
from hermes_core.cli.keying import MAX_JSON_BYTES
from hermes_core.cli.main import main
from hermes_core.config.loading import MAX_CONFIG_BYTES

KEY = ["key", "--platform", "telegram", "--chat-id", "9"]


@pytest.fixture(autouse=True)
def hermes_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.delenv("HERMES_DISABLE_PLUGINS", raising=False)
    return home


def error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one error line of a command that must fail with exit 2."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1, err
    assert err.startswith("hermes-sessions: error: ")
    return err


def script_error(*argv: str) -> str:
    """The one error line of the console script run on a special file, in a child whose memory
    and time are bounded: a regression (reading /dev/zero without bound, waiting on a FIFO)
    fails the test instead of exhausting the machine or hanging it."""

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    script = Path(sys.executable).with_name("hermes-sessions")
    result = subprocess.run(
        [str(script), *argv], capture_output=True, text=True, check=False, timeout=60,
        preexec_fn=bounded, env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("hermes-sessions: error: ")
    return result.stderr


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before", "after"])
def test_config_that_is_no_regular_file_is_refused_unread(where: str, fifo: Path) -> None:
    for name in ("/dev/zero", str(fifo), str(fifo.parent)):
        argv = ["--config", name, *KEY] if where == "before" else [*KEY, "--config", name]
        line = script_error(*argv)
        assert line.startswith(f"hermes-sessions: error: {name}: cannot read the file: ")


def test_a_config_over_its_bound_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    line = error_line(capsys, "--config", str(big), *KEY)
    assert f"larger than {MAX_CONFIG_BYTES:,} bytes" in line


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--source-json", "--payload"])
def test_source_and_payload_files_deep_huge_or_special_are_one_line(
    option: str,
    tmp_path: Path,
    fifo: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    platform = ["--platform", "telegram"] if option == "--payload" else []
    deep = tmp_path / "deep.json"
    deep.write_text('{"chat_id": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in error_line(capsys, "explain", option, str(deep), *platform)
    for special in ("/dev/zero", str(fifo)):
        assert "not a regular file" in script_error("explain", option, special, *platform)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" " * (MAX_JSON_BYTES + 1))))
    line = error_line(capsys, "explain", option, "-", *platform)
    assert f"standard input: cannot read the file: larger than {MAX_JSON_BYTES:,} bytes" in line


def test_a_store_url_that_is_not_utf8_text_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    target = "sqlite:///" + os.fsdecode(bytes(tmp_path) + b"/\xff.db")  # as argv decodes it
    for argv in (["migrate", "--to", target], ["ls", "--url", target]):
        line = error_line(capsys, *argv, "--state-dir", str(home))
        assert "the store URL holds bytes that are not UTF-8 text" in line
    assert sorted(os.listdir(tmp_path)) == ["home", "state"]  # no target database was created


def _events(tmp_path: Path, *lines: bytes) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _event(chat_id: str, text: str) -> bytes:
    source = {"platform": "telegram", "chat_id": chat_id, "user_id": "5"}
    return json.dumps({"source": source, "text": text}).encode()


def test_replay_skips_an_unkeyable_event_and_an_overlong_line_by_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = _events(
        tmp_path,
        _event("7", "first"),
        _event("7\n8", "an id no key can hold"),
        b"x" * (3 * MAX_EVENT_LINE),
        _event("7", "last"),
    )
    code = main(["replay", str(events), "--state-dir", str(tmp_path / "replayed")])
    out, err = capsys.readouterr()
    assert code == 1  # some lines skipped
    assert "replayed 2 event(s), skipped 2 line(s)" in out
    assert "echo: first" in out
    assert "echo: last" in out
    skipped = err.splitlines()
    assert len(skipped) == 2
    assert skipped[0].startswith(f"hermes-sessions: error: {events}:2: skipped: the session key ")
    assert skipped[1] == (
        f"hermes-sessions: error: {events}:3: skipped: longer than {MAX_EVENT_LINE:,} bytes"
    )


def test_replay_of_a_device_is_refused(tmp_path: Path) -> None:
    line = script_error("replay", "/dev/zero", "--state-dir", str(tmp_path / "replayed"))
    assert "/dev/zero: cannot read it (not a regular file or a pipe)" in line


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "is not valid UTF-8 JSON (truncated or edited?)"),
        (b"[1, 2]", "does not hold a JSON object"),
        (b"[" * 100_000, "is not valid UTF-8 JSON (truncated or edited?)"),
    ],
)
def test_import_of_a_malformed_sessions_json_is_an_error(
    content: bytes, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "state"
    populate(home)
    with sqlite3.connect(home / "state.db") as conn:
        before = conn.execute("SELECT count(*) FROM gateway_routing").fetchone()
    bad = tmp_path / "sessions.json"
    bad.write_bytes(content)
    line = error_line(capsys, "import-sessions-json", str(bad), "--state-dir", str(home))
    assert line == (
        f"hermes-sessions: error: {bad} {problem}; name a sessions.json: a JSON object of "
        "routing entries by session key, as a gateway writes it.\n"
    )
    with sqlite3.connect(home / "state.db") as conn:
        assert conn.execute("SELECT count(*) FROM gateway_routing").fetchone() == before


_FAILING_READER = """
from hermes_core import PlatformSpec, hookimpl

def read_event(payload, context):
    return payload["message"]["text"]  # a bug: KeyError on any other payload

@hookimpl
def hermes_register_platforms(config):
    return [PlatformSpec(name="acme", read_event=read_event)]
"""


def test_a_third_party_reader_that_raises_is_named_in_one_line(
    tmp_path: Path, fake_distribution: FakeDistribution, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_distribution(
        "hermes-acme", entry_points={"acme_reader": "acme_reader"},
        modules={"acme_reader": _FAILING_READER},
    )  # fmt: skip
    payload = tmp_path / "payload.json"
    payload.write_text('{"update": 1}')
    line = error_line(capsys, "explain", "--payload", str(payload), "--platform", "acme")
    assert line == (
        "hermes-sessions: error: plugin 'acme_reader' failed reading this acme payload "
        "(KeyError('message')); it is a bug in that plugin's read_event: report it to its "
        "authors with the payload, or disable the plugin (plugins.disable: [acme_reader]).\n"
    )
