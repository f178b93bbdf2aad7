"""A hostile ``sessions.json``: imported by ``import-sessions-json`` and by the first start of a
gateway on a fresh state directory, on SQLite and PostgreSQL. A bad entry is cleaned or skipped
with a warning and the others are imported; an entry naming another lane's session, or an origin
other than its key's chat, is refused, so no chat reads or is sent another chat's history."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from hermes_core import EchoAgent, Gateway, GatewayConfig, InMemoryAdapter, SessionStore
from hermes_core.cli.main import main
from hermes_core.testing import fresh_plugin_manager, telegram_dm

STAMP = "2026-01-01T00:00:00.000000+00:00"


def _key(chat: str) -> str:
    return f"agent:main:telegram:dm:c={chat}"


def _entry(chat: str, session_id: str, **fields: Any) -> dict[str, Any]:
    """A sessions.json entry of chat ``chat``'s DM lane."""
    origin = {"platform": "telegram", "chat_id": chat, "chat_type": "dm", "user_id": f"u{chat}"}
    return {
        "session_key": _key(chat), "session_id": session_id, "created_at": STAMP,
        "updated_at": STAMP, "platform": "telegram", "chat_type": "dm", "origin": origin,
        **fields,
    }  # fmt: skip


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


GOOD = _entry("1", "20260101_000000_00000001", display_name="Ana")
CLEANED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("surrogate-name", {"display_name": "x\ud800"}, {"display_name": "x\ufffd"}),
    ("surrogate-metadata", {"metadata": {"k\ud800": "v\udfff"}},
     {"metadata": {"k\ufffd": "v\ufffd"}}),
    ("surrogate-resume-reason", {"resume_reason": "\ud83d", "resume_pending": True},
     {"resume_reason": "\ufffd"}),
    ("surrogate-cost-status", {"cost_status": "ok\udc00"}, {"cost_status": "ok\ufffd"}),
    ("nul-name", {"display_name": "a\x00b", "metadata": {"n\x00": "\x00"}},
     {"display_name": "ab", "metadata": {"n": ""}}),
]  # fmt: skip
SKIPPED: list[tuple[str, dict[str, Any]]] = [
    ("tokens-2**63", {"input_tokens": 2**63}),
    ("tokens-2**70", {"total_tokens": 2**70}),
    ("negative-tokens", {"output_tokens": -1}),
    ("nested-metadata", {"metadata": {"deep": _nested(200)}}),
]


def _config(home: Path, settings: dict[str, Any]) -> GatewayConfig:
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def _import(home: Path, settings: dict[str, Any], path: Path) -> int:
    """``hermes-sessions import-sessions-json PATH`` on the state directory ``home`` (its store
    created first, when it has none)."""
    SessionStore.open(_config(home, settings), plugins=fresh_plugin_manager(home)).close()
    url = settings.get("storage", {}).get("url")
    where = ["--url", url] if url else []
    return main(["import-sessions-json", str(path), "--state-dir", str(home), *where, "--json"])


def _write(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(json.dumps({e["session_key"]: e for e in entries}), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("label", "fields", "expected"), CLEANED, ids=[c[0] for c in CLEANED])
def test_an_entry_with_unstorable_text_is_imported_in_its_normal_form(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str],
    label: str, fields: dict[str, Any], expected: dict[str, Any],
) -> None:  # fmt: skip
    home = tmp_path / "home"
    hostile = _entry("2", "20260101_000000_00000002", **fields)
    path = _write(tmp_path / "sessions.json", [GOOD, hostile])
    assert _import(home, settings, path) == 0
    assert json.loads(capsys.readouterr().out) == {"imported": 2}
    with SessionStore.open(_config(home, settings), read_only=True) as store:
        entry = store.lookup_by_session_key(_key("2"))
        assert entry is not None
        assert {name: getattr(entry, name) for name in expected} == expected
        assert store.peek_session_id(_key("1")) == GOOD["session_id"]


@pytest.mark.slow
@pytest.mark.parametrize(("label", "fields"), SKIPPED, ids=[s[0] for s in SKIPPED])
def test_an_entry_with_an_impossible_value_is_skipped_with_a_warning(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture, label: str, fields: dict[str, Any],
) -> None:  # fmt: skip
    home = tmp_path / "home"
    hostile = _entry("2", "20260101_000000_00000002", **fields)
    path = _write(tmp_path / "sessions.json", [GOOD, hostile])
    with caplog.at_level(logging.WARNING):
        assert _import(home, settings, path) == 0
    assert json.loads(capsys.readouterr().out) == {"imported": 1}
    assert f"skipping entry '{_key('2')}'" in caplog.text
    with SessionStore.open(_config(home, settings), read_only=True) as store:
        assert store.peek_session_id(_key("2")) is None
        assert store.peek_session_id(_key("1")) == GOOD["session_id"]


def test_an_entry_naming_another_lanes_session_is_refused(
    tmp_path: Path, settings: dict[str, Any], capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Chat 2's entry carries the session id of chat 1's lane: importing it would show chat 1's
    history to chat 2's next turn."""
    home = tmp_path / "home"
    config = _config(home, settings)
    with SessionStore.open(config, plugins=fresh_plugin_manager(home)) as store:
        lane = store.get_or_create_session(telegram_dm("1"))
        store.append_to_transcript(lane.session_id, {"role": "user", "content": "chat 1 secret"})
    thief = _entry("2", lane.session_id)
    twins = [_entry("3", "20260101_000000_00000003"), _entry("4", "20260101_000000_00000003")]
    path = _write(tmp_path / "sessions.json", [thief, *twins, _entry("5", "20260101_000000_05")])
    with caplog.at_level(logging.WARNING):
        assert _import(home, settings, path) == 0
    assert json.loads(capsys.readouterr().out) == {"imported": 1}
    assert f"belongs to lane '{_key('1')}'" in caplog.text
    assert "belongs to several entries" in caplog.text
    with SessionStore.open(config, read_only=True) as store:
        assert [store.peek_session_id(_key(chat)) for chat in "2345"] == [
            None, None, None, "20260101_000000_05",
        ]  # fmt: skip
        assert store.peek_session_id(_key("1")) == lane.session_id


def test_the_first_start_imports_a_hostile_file_and_resumes_only_matching_origins(
    tmp_path: Path, settings: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway's first start on a fresh state directory imports sessions.json: an entry with
    unstorable text no longer stops it, and an entry whose origin is another chat than its key's
    (with a turn to resume) is skipped, so nothing is sent to that chat."""
    home = tmp_path / "home"
    wrong_origin = _entry("2", "20260101_000000_00000002", resume_pending=True,
                          resume_reason="restart_timeout")  # fmt: skip
    wrong_origin["origin"] = {**wrong_origin["origin"], "chat_id": "666"}
    entries = [
        GOOD,
        _entry("3", "20260101_000000_00000003", display_name="\ud800", metadata={"\ud800": 1}),
        _entry("4", "20260101_000000_00000004", input_tokens=2**64),
        wrong_origin,
    ]
    _write(home / "sessions" / "sessions.json", entries)
    config = _config(home, settings)
    telegram = InMemoryAdapter("telegram")

    async def first_start() -> None:
        gateway = Gateway(config, fresh_plugin_manager(home), lambda entry: EchoAgent(),
                          [telegram])  # fmt: skip
        await gateway.start()
        await asyncio.wait_for(gateway.idle(), 30)
        assert await gateway.stop()

    with caplog.at_level(logging.WARNING):
        asyncio.run(first_start())
    assert "its origin is another chat than its key names" in caplog.text
    assert telegram.texts("666") == []
    with SessionStore.open(config, read_only=True) as store:
        assert [store.peek_session_id(_key(chat)) for chat in "1234"] == [
            GOOD["session_id"], None, "20260101_000000_00000003", None,
        ]  # fmt: skip
