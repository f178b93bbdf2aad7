"""The delivery ledger and auto-resume eligibility."""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.turns.ledger import (
    RATE_LIMIT_PREFIX,
    RECONNECT_PREFIX,
    RESTART_PREFIX,
    SendResult,
    is_silent_reply,
)
from hermes_core.turns.resume import freshness_epoch, is_fresh, resume_candidates, resume_note


@pytest.fixture
def store(hermes_home: Path) -> Iterator[SessionStore]:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    opened = SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home))
    yield opened
    opened.close()


def _record(store: SessionStore, content: str = "the answer", ref: str = "m1") -> str:
    recorded = store._turns.record_delivery_obligation(
        "agent:main:telegram:dm:99", None, "telegram", "99", None, content, ref
    )
    assert recorded is not None
    return recorded.obligation_id


@pytest.mark.parametrize(
    ("text", "silent"),
    [
        ("[SILENT]", True), ("silent", True), (" no_reply ", True), ("NO   REPLY", True),
        ("[静默]", True), ("沉默", True), ("...SILENT!", True), ("“NO_REPLY”", True),
        ("[SILENT", False), ("SILENT]", False), ("I will stay SILENT now", False), ("", False),
        ("   ", False), ("SILENT" * 20, False), (None, False),
    ],
)  # fmt: skip
def test_silent_markers(text: Any, silent: bool) -> None:
    assert is_silent_reply(text) is silent


def test_record_is_idempotent_and_clears_the_owning_marker(store: SessionStore) -> None:
    entry = store.get_or_create_session(telegram_dm())
    old = store.mark_turn_active(entry.session_key)
    token = store.mark_turn_active(entry.session_key)
    assert old is not None
    assert token is not None
    expected = hashlib.sha256(f"{entry.session_key}|m1|hi".encode()).hexdigest()
    stale = store._turns.record_delivery_obligation(
        entry.session_key, entry.session_id, "telegram", "99", None, "hi", "m1", turn_token=old
    )
    assert stale is not None
    assert stale.obligation_id == expected
    lane = store.lookup_by_session_key(entry.session_key)
    assert lane is not None
    assert lane.active_turn_token == token
    again = store._turns.record_delivery_obligation(
        entry.session_key, entry.session_id, "telegram", "99", None, "hi", "m1", turn_token=token
    )
    assert again is not None
    assert again.obligation_id == expected
    lane = store.lookup_by_session_key(entry.session_key)
    assert lane is not None
    assert lane.active_turn_token is None
    ledger = store._obligations.ledger
    assert ledger is not None
    assert len(ledger.rows.obligations(("pending",))) == 1


def test_a_permanent_failure_is_abandoned_at_once(store: SessionStore) -> None:
    _record(store)
    ledger = store._obligations.ledger
    assert ledger is not None
    claimed = ledger.claim(ledger.rows.obligations(("pending",))[0])
    assert claimed is not None
    blocked = SendResult(ok=False, failure_kind="permanent", error="bot was blocked by the user")
    assert not ledger.settle(claimed, blocked)
    abandoned = ledger.rows.obligations(("abandoned",))
    assert [(r.failure_kind, r.last_error) for r in abandoned] == [
        ("permanent", "bot was blocked by the user")
    ]
    assert ledger.due("boot", ["telegram"]) == []


def test_claim_and_settle(store: SessionStore) -> None:
    _record(store)
    ledger = store._obligations.ledger
    assert ledger is not None
    row = ledger.rows.obligations(("pending",))[0]
    claimed = ledger.claim(row)
    assert claimed is not None
    assert (claimed.state, claimed.attempts) == ("attempting", 1)
    assert ledger.rows.obligations(("attempting",)) == [claimed]
    offline = SendResult(ok=False, failure_kind="disconnected", error="offline")
    assert not ledger.settle(claimed, offline)
    failed = ledger.rows.obligations(("failed",))
    assert [(r.failure_kind, r.attempts, r.last_error) for r in failed] == [
        ("disconnected", 1, "offline")
    ]
    again = ledger.claim(failed[0])
    assert again is not None
    assert ledger.settle(again, SendResult(ok=True))
    assert ledger.rows.obligations(("pending", "attempting", "failed")) == []


def test_a_row_without_attempts_left_is_abandoned_when_claimed(store: SessionStore) -> None:
    ledger = store._obligations.ledger
    assert ledger is not None
    tired = _record(store)
    ledger.rows.update_obligation(tired, {"state": "failed", "attempts": 3})
    assert ledger.claim(ledger.rows.obligations(("failed",))[0]) is None
    assert [row.obligation_id for row in ledger.rows.obligations(("abandoned",))] == [tired]


def _plan(store: SessionStore, occasion: Any, platform: str = "telegram") -> dict[str, str | None]:
    ledger = store._obligations.ledger
    assert ledger is not None
    return {row.content: prefix for row, prefix in ledger.due(occasion, [platform])}


def test_boot_sweep_prefixes_ambiguous_rows(store: SessionStore) -> None:
    ledger = store._obligations.ledger
    assert ledger is not None
    _pending, attempting, failed = (_record(store, f"reply {i}", f"m{i}") for i in range(3))
    ledger.rows.update_obligation(attempting, {"state": "attempting", "attempts": 1})
    ledger.rows.update_obligation(failed, {"state": "failed", "attempts": 1})
    crash = store._turns.record_delivery_obligation(
        "agent:main:telegram:dm:99", None, "telegram", "99", None, "crash-left", "crash:t",
        origin_kind="crash",
    )  # fmt: skip
    assert crash is not None
    assert _plan(store, "boot") == {
        "reply 0": None, "reply 1": RESTART_PREFIX, "reply 2": RESTART_PREFIX,
        "crash-left": RESTART_PREFIX,
    }  # fmt: skip
    assert _plan(store, "boot", "discord") == {}
    skipped = ledger.due("boot", ["telegram"], skip={attempting})
    assert attempting not in {row.obligation_id for row, _ in skipped}


def test_a_marked_resend_that_may_have_arrived_is_not_sent_again(store: SessionStore) -> None:
    ledger = store._obligations.ledger
    assert ledger is not None
    _record(store)
    first = ledger.claim(ledger.rows.obligations(("pending",))[0])
    assert first is not None  # the turn's plain send, then the process died
    resend = ledger.claim(first, marked=True)  # the boot sweep's marked re-send, then it died
    assert resend is not None
    assert resend.marked_sends == 1
    assert _plan(store, "boot") == {}  # one marked delivery at most: given up, not re-sent
    assert [row.last_error for row in ledger.rows.obligations(("abandoned",))] == [
        "a marked re-send may already have arrived"
    ]


def test_stale_and_exhausted_replies_are_abandoned(
    store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = store._obligations.ledger
    assert ledger is not None
    stale, tired = _record(store, "old", "m1"), _record(store, "tired", "m2")
    ledger.rows.update_obligation(stale, {"created_at": 1.0})
    ledger.rows.update_obligation(tired, {"state": "failed", "attempts": 3})
    with caplog.at_level(logging.WARNING):
        assert _plan(store, "boot") == {}
    assert "agent:main:telegram:dm:99" in caplog.text
    assert "s old" in caplog.text
    abandoned = {row.obligation_id for row in ledger.rows.obligations(("abandoned",))}
    assert abandoned == {stale, tired}


def test_runtime_retries_carry_their_own_prefix(store: SessionStore) -> None:
    ledger = store._obligations.ledger
    assert ledger is not None
    lost, limited, _owed, claimed = (
        _record(store, text, f"m{n}") for n, text in enumerate(("lost", "limited", "owed", "sent?"))
    )
    ledger.rows.update_obligation(lost, {"state": "failed", "failure_kind": "disconnected"})
    ledger.rows.update_obligation(limited, {"state": "failed", "failure_kind": "rate_limited"})
    ledger.rows.update_obligation(claimed, {"state": "attempting", "attempts": 1})
    assert _plan(store, "reconnect") == {
        "lost": RECONNECT_PREFIX, "owed": None, "sent?": RECONNECT_PREFIX
    }  # fmt: skip
    assert _plan(store, "rate_limit") == {"limited": RATE_LIMIT_PREFIX}


def test_housekeeping_applies_retention_and_the_row_cap(hermes_home: Path) -> None:
    config = GatewayConfig.from_dict(
        {"gateway": {"delivery_ledger": {"max_rows": 2, "retention_days": 1}}},
        environ={"HERMES_HOME": str(hermes_home)},
    )
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        ledger = store._obligations.ledger
        assert ledger is not None
        ids = [_record(store, f"r{i}", f"m{i}") for i in range(5)]
        for age, obligation in enumerate(ids):
            ledger.rows.update_obligation(
                obligation, {"state": "abandoned", "updated_at": 10_000_000_000 - age}
            )
        ledger.rows.update_obligation(ids[4], {"updated_at": 1.0})  # past retention
        _record(store, "still owed", "m9")
        assert ledger.housekeeping() == 3
        kept = {row.obligation_id for row in ledger.rows.obligations(("abandoned",))}
        assert kept == set(ids[:2])
        assert len(ledger.rows.obligations(("pending",))) == 1


def test_disabled_ledger_records_nothing(hermes_home: Path) -> None:
    config = GatewayConfig.from_dict({"gateway": {"delivery_ledger": False}},
                                     environ={"HERMES_HOME": str(hermes_home)})  # fmt: skip
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert store._obligations.ledger is None
        assert (
            store._turns.record_delivery_obligation("k", None, "telegram", "1", None, "x", "m")
            is None
        )
        assert store.health()["ledger"] == "disabled"


# -- resume -------------------------------------------------------------------------------------


def test_resume_notes_are_exact() -> None:
    assert resume_note("restart_timeout", synthesized=False) == (
        "[System note: Your previous turn was interrupted by a gateway restart before it "
        "finished. The conversation history above is intact. Respond to the NEW message below "
        "first; do not repeat tool calls from the interrupted turn unless the user asks, and "
        "never re-execute a restart or shutdown command.]"
    )
    assert resume_note("other", synthesized=True) == (
        "[System note: Your previous turn was interrupted by a gateway interruption before it "
        "finished. The conversation history above is intact. Continue the interrupted task now "
        "instead of only acknowledging that the session was restored. Tool calls in the history "
        "without a result have an UNKNOWN effect: check their effect before repeating them, and "
        "never re-execute a restart or shutdown command.]"
    )


@pytest.mark.parametrize(
    ("value", "epoch"),
    [
        (1_700_000_000, 1_700_000_000.0), (1_700_000_000_000, 1_700_000_000.0),
        ("1700000000", 1_700_000_000.0), ("2023-11-14T22:13:20Z", 1_700_000_000.0),
        (datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc), 1_700_000_000.0),
        (True, None), ("soon", None), (None, None), (float("nan"), None), ([], None),
    ],
)  # fmt: skip
def test_freshness_timestamps(value: object, epoch: float | None) -> None:
    assert freshness_epoch(value) == epoch


def test_freshness_window() -> None:
    assert is_fresh(100.0, 60, now=160.0)  # equal age is fresh
    assert not is_fresh(100.0, 60, now=160.5)
    assert is_fresh(0.0, 0, now=1e9)  # window <= 0: everything is fresh
    assert is_fresh("unknown", 60, now=1e9)


def test_resume_candidates_follow_the_eligibility_rules(hermes_home: Path) -> None:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    keys = {}
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        for chat in ("ok", "manual", "suspended", "busy", "old", "offline"):
            platform = "discord" if chat == "offline" else "telegram"
            source = telegram_dm(chat).replace(platform=platform)
            keys[chat] = store.get_or_create_session(source).session_key
            reason = "manual" if chat == "manual" else "restart_timeout"
            store.mark_resume_pending(keys[chat], reason)
        store.suspend_session(keys["suspended"])
    old = (datetime.now(timezone.utc) - timedelta(hours=2)).isoformat()
    conn = sqlite3.connect(hermes_home / "state.db")
    (text,) = conn.execute("SELECT entry_json FROM gateway_routing WHERE session_key = ?",
                           (keys["old"],)).fetchone()  # fmt: skip
    aged = {**json.loads(text), "last_resume_marked_at": old}
    conn.execute("UPDATE gateway_routing SET entry_json = ? WHERE session_key = ?",
                 (json.dumps(aged), keys["old"]))  # fmt: skip
    conn.commit()
    conn.close()
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        chosen = resume_candidates(
            store, 3600, busy=lambda key: key == keys["busy"],
            connected=lambda platform: platform == "telegram",
        )  # fmt: skip
        assert [entry.session_key for entry in chosen] == [keys["ok"]]
        on_discord = resume_candidates(store, 3600, platform="discord")
        assert [entry.session_key for entry in on_discord] == [keys["offline"]]
        everything_fresh = resume_candidates(store, 0)
        assert keys["old"] in {entry.session_key for entry in everything_fresh}
