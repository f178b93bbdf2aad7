"""Restart recovery: instance lock, clean-shutdown marker, turn markers, stuck-loop
counting, crash-left replies and recovery-step isolation."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core import (
    EchoAgent,
    Gateway,
    GatewayConfig,
    InMemoryAdapter,
    MessageEvent,
    RecoveryContext,
    RecoveryStep,
)
from hermes_core.domain.errors import GatewayLockedError, MessageNotStoredError
from hermes_core.domain.specs import CrashRecoveryResult, StuckLoopResult
from hermes_core.state.instance import InstanceLock, RestartCounts
from hermes_core.store import SessionStore
from hermes_core.testing import RecoveryStepsPlugin, fresh_plugin_manager, telegram_dm
from hermes_core.turns.ledger import RESTART_PREFIX, SILENCE_NOTICE
from hermes_core.turns.recovery import GatewayState, RecoveryAbortedError, record_crash_left_replies


def _config(home: Path, **settings: Any) -> GatewayConfig:
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


@pytest.fixture
def state(hermes_home: Path) -> Iterator[Callable[..., GatewayState]]:
    """Starts gateway states on the test's home; each is released at the end."""
    started: list[GatewayState] = []

    def start(**settings: Any) -> GatewayState:
        gateway = GatewayState(_config(hermes_home, **settings),
                               plugins=fresh_plugin_manager(hermes_home))  # fmt: skip
        gateway.start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway._release()


def _store(gateway: GatewayState) -> SessionStore:
    assert gateway.store is not None
    return gateway.store


def _interrupted_turn(store: SessionStore, chat: str = "99") -> tuple[str, str]:
    entry = store.get_or_create_session(telegram_dm(chat))
    token = store.mark_turn_active(entry.session_key, user_message={"role": "user", "content": "q"})
    assert token is not None
    return entry.session_key, token


# -- instance lock and clean shutdown --------------------------------------------------------------


def test_instance_lock_is_exclusive_and_records_boots(hermes_home: Path) -> None:
    first = InstanceLock.acquire(hermes_home)
    with pytest.raises(GatewayLockedError, match=r"pid \d+"):
        InstanceLock.acquire(hermes_home)
    first.release()
    second = InstanceLock.acquire(hermes_home)
    assert second.previous_boot_id == first.boot_id
    record = json.loads((hermes_home / "gateway.lock").read_text())
    assert record["boot_id"] == second.boot_id
    assert isinstance(record["pid"], int)
    second.release()


def test_clean_stop_discards_markers_without_resume(state: Callable[..., GatewayState]) -> None:
    gateway = state()
    key, _ = _interrupted_turn(_store(gateway))
    assert gateway.stop(drained=True)
    assert (gateway.config.hermes_home / ".clean_shutdown").exists()
    again = state()
    entry = _store(again).lookup_by_session_key(key)
    assert entry is not None
    assert entry.active_turn_token is None
    assert not entry.resume_pending
    assert not (again.config.hermes_home / ".clean_shutdown").exists()
    assert again.context is not None
    assert again.context.last_stop_clean
    report = again.context.report
    assert report.crash_recovery == CrashRecoveryResult(clean=True, markers_discarded=1)
    assert report.stuck_loop == StuckLoopResult(counts={}, suspended=())


def test_missing_marker_means_crash_recovery(state: Callable[..., GatewayState]) -> None:
    gateway = state()
    key, _ = _interrupted_turn(_store(gateway))
    gateway.stop(drained=False)  # the drain timed out: no .clean_shutdown
    again = state()
    entry = _store(again).lookup_by_session_key(key)
    assert entry is not None
    assert entry.resume_pending
    assert entry.resume_reason == "restart_interrupted"
    assert entry.active_turn_token is None
    assert json.loads((again.config.hermes_home / "restart_counts.json").read_text()) == {key: 1}
    assert again.context is not None
    report = again.context.report  # clean_shutdown hands the interrupted lanes to stuck_loop
    assert report.crash_recovery is not None
    assert (report.crash_recovery.clean, report.crash_recovery.armed) == (False, (key,))
    assert report.crash_recovery.interrupted == (key,)
    assert report.stuck_loop == StuckLoopResult(counts={key: 1}, suspended=())
    assert report.outcomes["stuck_loop"] == "ok"


def test_marker_of_another_boot_is_not_trusted(
    state: Callable[..., GatewayState], caplog: pytest.LogCaptureFixture
) -> None:
    gateway = state()
    key, _ = _interrupted_turn(_store(gateway))
    gateway.stop(drained=False)
    marker = gateway.config.hermes_home / ".clean_shutdown"
    marker.write_text(json.dumps({"boot_id": "0" * 32, "written_at": "x"}))
    with caplog.at_level(logging.WARNING):
        again = state()
    assert "another boot" in caplog.text
    entry = _store(again).lookup_by_session_key(key)
    assert entry is not None
    assert entry.resume_pending
    assert not marker.exists()


def test_undeletable_marker_refuses_to_start(
    state: Callable[..., GatewayState], hermes_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = state()
    key, _ = _interrupted_turn(_store(gateway))
    gateway.stop(drained=True)
    original = Path.unlink

    def refuse(path: Path, missing_ok: bool = False) -> None:
        if path.name == ".clean_shutdown":
            raise PermissionError("read-only")
        original(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    blocked = GatewayState(_config(hermes_home), plugins=fresh_plugin_manager(hermes_home))
    with pytest.raises(RecoveryAbortedError, match="clean-start recovery cleanup failed"):
        blocked.start()
    monkeypatch.undo()
    # The lock was released; the marker now names an older boot than the failed start, so the
    # retry recovers as after a crash and finds the markers already discarded (durably first).
    retry = state()
    assert retry.context is not None
    assert not retry.context.last_stop_clean
    entry = _store(retry).lookup_by_session_key(key)
    assert entry is not None
    assert not entry.resume_pending
    assert entry.active_turn_token is None
    assert not (hermes_home / ".clean_shutdown").exists()


# -- turn markers --------------------------------------------------------------------------------


def _age_marker(store: SessionStore, key: str, started: str) -> None:
    """Rewrite a stored marker's start as an older version (schema 2) left it: in the entry's
    JSON only. Opening the store again upgrades it, taking the start from there."""
    path = store.config.hermes_home / "state.db"
    conn = sqlite3.connect(path)
    row = conn.execute("SELECT entry_json FROM gateway_routing WHERE session_key = ?", (key,))
    entry = json.loads(row.fetchone()[0])
    entry["active_turn_started_at"] = started
    conn.execute(
        "UPDATE gateway_routing SET entry_json = ?, active_turn_started_at = NULL "
        "WHERE session_key = ?",
        (json.dumps(entry), key),
    )
    conn.execute("UPDATE schema_version SET version = 2")
    conn.commit()
    conn.close()


def _fresh_store(home: Path) -> SessionStore:
    return SessionStore.open(_config(home), plugins=fresh_plugin_manager(home))


def test_recover_turn_markers_arms_fresh_markers_only(hermes_home: Path) -> None:
    store = _fresh_store(hermes_home)
    fresh, _ = _interrupted_turn(store, "1")
    stale, _ = _interrupted_turn(store, "2")
    suspended, _ = _interrupted_turn(store, "3")
    kept, _ = _interrupted_turn(store, "4")
    store.suspend_session(suspended)
    store.mark_resume_pending(kept, "shutdown_timeout")
    old = (datetime.now(timezone.utc) - timedelta(hours=2)).isoformat()
    store.close()
    _age_marker(store, stale, old)
    store = _fresh_store(hermes_home)
    recovered = store._turns.recover_turn_markers(3600)
    assert recovered.armed == (fresh,)
    assert recovered.kept == (kept,)
    assert recovered.cleared == 4
    assert set(recovered.struck) == {fresh, kept}
    for key in (fresh, stale, suspended, kept):
        entry = store.lookup_by_session_key(key)
        assert entry is not None
        assert entry.active_turn_token is None
    kept_entry = store.lookup_by_session_key(kept)
    assert kept_entry is not None
    assert kept_entry.resume_reason == "shutdown_timeout"
    suspended_entry = store.lookup_by_session_key(suspended)
    assert suspended_entry is not None
    assert not suspended_entry.resume_pending
    assert store._turns.recover_turn_markers(3600).armed == ()  # nothing left to recover
    store.close()


def test_marker_age_survives_a_time_zone_change(
    hermes_home: Path, local_timezone: Callable[[str], None]
) -> None:
    local_timezone("Asia/Tokyo")
    store = _fresh_store(hermes_home)
    key, _ = _interrupted_turn(store)
    store.close()
    local_timezone("America/Los_Angeles")  # 17 hours earlier on the wall clock
    store = _fresh_store(hermes_home)
    assert store._turns.recover_turn_markers(3600).armed == (key,)
    store.close()


def test_legacy_naive_marker_is_host_local_time(
    hermes_home: Path, local_timezone: Callable[[str], None]
) -> None:
    local_timezone("Europe/Berlin")
    store = _fresh_store(hermes_home)
    key, _ = _interrupted_turn(store)
    store.close()
    naive_now = datetime.now().replace(tzinfo=None).isoformat()  # an older writer's local time
    _age_marker(store, key, naive_now)
    store = _fresh_store(hermes_home)
    assert store._turns.recover_turn_markers(3600).armed == (key,)
    store.close()


def test_restart_counts_file(hermes_home: Path) -> None:
    counts = RestartCounts(hermes_home)
    assert counts.load() == {}
    counts.save({"b": 2, "a": 1})
    assert json.loads(counts.path.read_text()) == {"a": 1, "b": 2}
    counts.remove("a")
    assert RestartCounts(hermes_home).load() == {"b": 2}
    counts.remove("b")
    assert not counts.path.exists()
    counts.path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"k": 2, "bad": "x"}).encode())
    assert RestartCounts(hermes_home).load() == {"k": 2}  # BOM tolerated, junk dropped
    counts.path.write_text("{torn")
    assert RestartCounts(hermes_home).load() == {}


# -- crash-left replies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "reply", "outcome", "sent_text"),
    [
        ({"role": "user", "content": "q", "platform_message_id": "m7"},
         {"role": "assistant", "content": "answer"}, "recorded", f"{RESTART_PREFIX}\n\nanswer"),
        ({"role": "user", "content": "q"}, {"role": "assistant", "content": " NO_REPLY "},
         "silence_notice", f"{RESTART_PREFIX}\n\n{SILENCE_NOTICE}"),
        ({"role": "user", "content": "", "display_kind": "internal_notification"},
         {"role": "assistant", "content": "[SILENT]"}, "nothing_owed", None),
        ({"role": "user", "content": "q"},
         {"role": "assistant", "content": "calling", "tool_calls": [{"id": "1"}]}, None, None),
    ],
    ids=["reply", "silence", "machinery-silence", "tool-call"],
)  # fmt: skip
def test_crash_left_replies(
    hermes_home: Path,
    user: dict[str, Any],
    reply: dict[str, Any],
    outcome: str | None,
    sent_text: str | None,
) -> None:
    store = _fresh_store(hermes_home)
    entry = store.get_or_create_session(telegram_dm())
    token = store.mark_turn_active(entry.session_key, user_message=user)
    assert token is not None
    store.append_to_transcript(entry.session_id, reply)
    results = record_crash_left_replies(store, store.config)
    assert results.get(entry.session_key) == outcome
    marker = store.lookup_by_session_key(entry.session_key)
    assert marker is not None
    assert (marker.active_turn_token is None) is (outcome is not None)
    ledger = store._obligations.ledger
    assert ledger is not None
    due = ledger.due("boot", ["telegram"])
    assert [f"{prefix}\n\n{row.content}" for row, prefix in due] == (
        [sent_text] if sent_text else []
    )
    for row, _prefix in due:  # threaded under the message it answers, not the lane's first
        assert row.reply_to_message_id == user.get("platform_message_id")
    store.close()


def test_reply_already_ledgered_only_clears_the_marker(hermes_home: Path) -> None:
    store = _fresh_store(hermes_home)
    entry = store.get_or_create_session(telegram_dm())
    token = store.mark_turn_active(entry.session_key)
    assert token is not None
    store._turns.record_delivery_obligation(
        entry.session_key, entry.session_id, "telegram", "99", None, "done", "m1"
    )
    assert record_crash_left_replies(store, store.config) == {entry.session_key: "ledgered"}
    lane = store.lookup_by_session_key(entry.session_key)
    assert lane is not None
    assert lane.active_turn_token is None
    store.close()


# -- recovery steps from plugins -------------------------------------------------------------


def _failing(context: RecoveryContext) -> None:
    raise RuntimeError("plugin step broke")


def _recording(context: RecoveryContext) -> None:
    context.report.extra["after"] = "ran"


def test_non_critical_step_failure_is_isolated(
    hermes_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugins = fresh_plugin_manager(hermes_home)
    plugins.register(RecoveryStepsPlugin(RecoveryStep(name="flaky", order=250, run=_failing),
                            RecoveryStep(name="after", order=260, run=_recording)),
                     name="extra")  # fmt: skip
    gateway = GatewayState(_config(hermes_home), plugins=plugins)
    with caplog.at_level(logging.ERROR):
        gateway.start()
    assert gateway.context is not None
    assert gateway.context.report.outcomes["flaky"] == "failed: plugin step broke"
    assert gateway.context.report.extra == {"after": "ran"}
    assert "recovery step flaky failed" in caplog.text
    gateway.stop(drained=True)


def test_critical_step_failure_aborts_start_and_releases_the_lock(hermes_home: Path) -> None:
    plugins = fresh_plugin_manager(hermes_home)
    vital = RecoveryStep(name="vital", order=350, run=_failing, critical=True)
    plugins.register(RecoveryStepsPlugin(vital), name="extra")
    with pytest.raises(RecoveryAbortedError, match="recovery step vital failed"):
        GatewayState(_config(hermes_home), plugins=plugins).start()
    InstanceLock.acquire(hermes_home).release()  # the failed start let go of the lock


async def test_a_message_after_a_failed_start_is_refused_as_not_stored(hermes_home: Path) -> None:
    """A host that goes on after ``start()`` raised gets the error that tells it to leave the
    platform's message unacknowledged, and nothing is sent."""
    plugins = fresh_plugin_manager(hermes_home)
    vital = RecoveryStep(name="vital", order=350, run=_failing, critical=True)
    plugins.register(RecoveryStepsPlugin(vital), name="extra")
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(_config(hermes_home), plugins, lambda entry: EchoAgent(), [adapter])
    with pytest.raises(RecoveryAbortedError):
        await gateway.start()
    event = MessageEvent(source=telegram_dm("42"), text="hello", message_id="m1")
    with pytest.raises(MessageNotStoredError, match="did not start"):
        await gateway.handle_message(event)
    assert adapter.sent == []
