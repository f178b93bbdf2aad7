"""The store contract kit: every storage backend runs it (needs pytest, the ``test`` extra).

Subclass :class:`StoreContract` in a test module as ``TestMyStore`` and provide the
``store_factory`` fixture: a callable that opens a :class:`~hermes_core.store.SessionStore` over
your backend for one state directory (calling it again with the same directory reopens the same
store, which the persistence tests rely on). The class holds the tests of the required
protocol; it includes the tests of every capability (:mod:`.feature_contract`,
:mod:`.deployment_contract`), which follow what the backend's ``StoreSpec.capabilities``
declares.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest

from hermes_core.domain.errors import (
    InvalidValueError,
)
from hermes_core.domain.keys import parse_session_key
from hermes_core.store import SessionStore
from hermes_core.testing import telegram_dm
from hermes_core.testing.contract_base import StoreFactory
from hermes_core.testing.deployment_contract import DeploymentContract
from hermes_core.testing.feature_contract import FeatureContract

__all__ = ["StoreContract", "StoreFactory"]

SESSION_ID_RE = re.compile(r"\d{8}_\d{6}_[0-9a-f]{8}")


class StoreContract(FeatureContract, DeploymentContract):
    """Behaviour every store backend must show. Tests of a capability run where the store's
    ``health()["capabilities"]`` says the backend offers it; their ``*_without_*`` twins check
    what the store does where it does not (one of each pair is skipped)."""

    # -- get_or_create ---------------------------------------------------------------------------

    def test_creates_then_returns_the_same_session(self, store: SessionStore) -> None:
        source = telegram_dm(chat_name="Chat", user_name="Alice")
        first = store.get_or_create_session(source)
        assert first.session_key == "agent:main:telegram:dm:c=99"
        assert SESSION_ID_RE.fullmatch(first.session_id)
        assert first.origin == source
        assert (first.platform, first.chat_type, first.display_name) == ("telegram", "dm", "Chat")
        second = store.get_or_create_session(source)
        assert second.session_id == first.session_id
        assert second.updated_at >= first.updated_at

    def test_touch_activity_false_keeps_updated_at(self, store: SessionStore) -> None:
        first = store.get_or_create_session(telegram_dm())
        again = store.get_or_create_session(telegram_dm(), touch_activity=False)
        assert again.updated_at == first.updated_at
        touched = store.get_or_create_session(telegram_dm())
        assert touched.updated_at > first.updated_at

    def test_force_new_ends_the_old_session(self, store: SessionStore) -> None:
        old = store.get_or_create_session(telegram_dm())
        new = store.get_or_create_session(telegram_dm(), force_new=True)
        assert new.session_id != old.session_id
        assert new.prev_session_id == old.session_id
        assert not new.is_fresh_reset
        assert not new.was_auto_reset

    def test_suspension_replaces_the_session_on_next_access(self, store: SessionStore) -> None:
        old = store.get_or_create_session(telegram_dm())
        store.update_session(old.session_key, last_prompt_tokens=50)
        assert store.mark_resume_pending(old.session_key)
        assert store.suspend_session(old.session_key)
        assert not store.mark_resume_pending(old.session_key)  # suspended entries are not armed
        new = store.get_or_create_session(telegram_dm())
        assert new.session_id != old.session_id
        assert (new.was_auto_reset, new.auto_reset_reason) == (True, "suspended")
        assert (new.prev_session_id, new.reset_had_activity) == (old.session_id, True)
        assert not new.suspended
        assert not new.resume_pending
        assert not store.suspend_session("agent:main:telegram:dm:c=unknown")

    def test_reset_starts_a_fresh_session_and_keeps_history(self, store: SessionStore) -> None:
        old = store.get_or_create_session(telegram_dm(chat_name="Old name"))
        store.append_to_transcript(old.session_id, {"role": "user", "content": "remember me"})
        store.update_session(old.session_key, input_tokens=3, output_tokens=4)
        store.set_session_metadata(old.session_key, "mode", "x")
        store.mark_resume_pending(old.session_key)
        new = store.reset_session(old.session_key, display_name="New name")
        assert new is not None
        assert new.session_id != old.session_id
        assert (new.is_fresh_reset, new.prev_session_id) == (True, old.session_id)
        assert (new.reset_had_activity, new.display_name) == (False, "New name")
        assert (new.input_tokens, new.total_tokens, new.metadata) == (0, 0, {})
        assert not new.resume_pending
        assert new.active_turn_token is None
        assert new.origin == old.origin
        assert store.peek_session_id(old.session_key) == new.session_id
        assert [m["content"] for m in store.load_transcript(old.session_id)] == ["remember me"]
        assert store.reset_session("agent:main:telegram:dm:c=unknown") is None

    # -- flags and markers -------------------------------------------------------------------------

    def test_resume_pending_flags(self, store: SessionStore) -> None:
        key = store.get_or_create_session(telegram_dm()).session_key
        assert not store.clear_resume_pending(key)
        assert store.mark_resume_pending(key, "shutdown_timeout")
        entry = store.lookup_by_session_key(key)
        assert entry is not None
        assert entry.resume_pending
        assert entry.resume_reason == "shutdown_timeout"
        assert entry.last_resume_marked_at is not None
        assert store.clear_resume_pending(key)
        cleared = store.lookup_by_session_key(key)
        assert cleared is not None
        assert (cleared.resume_pending, cleared.resume_reason) == (False, None)
        assert cleared.last_resume_marked_at is None
        assert not store.mark_resume_pending("agent:main:telegram:dm:c=unknown")

    def test_turn_marker_compare_and_swap(self, store: SessionStore) -> None:
        entry = store.get_or_create_session(telegram_dm())
        first = store.mark_turn_active(entry.session_key)
        assert first is not None
        assert re.fullmatch(r"[0-9a-f]{32}", first)
        marked = store.lookup_by_session_key(entry.session_key)
        assert marked is not None
        assert marked.active_turn_token == first
        assert marked.active_turn_started_at is not None
        assert marked.updated_at == entry.updated_at  # a turn is not user activity
        second = store.mark_turn_active(entry.session_key)
        assert second is not None
        assert second != first
        assert not store.clear_turn_active(entry.session_key, first)  # a newer turn owns it
        assert store.clear_turn_active(entry.session_key, second)
        assert not store.clear_turn_active(entry.session_key, second)
        assert store.mark_turn_active("agent:main:telegram:dm:c=unknown") is None

    def test_marker_and_user_message_are_stored_together(self, store: SessionStore) -> None:
        entry = store.get_or_create_session(telegram_dm())
        token = store.mark_turn_active(
            entry.session_key, user_message={"role": "user", "content": "hello"}
        )
        assert token is not None
        assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["hello"]

    def test_update_session_counters(self, store: SessionStore) -> None:
        entry = store.get_or_create_session(telegram_dm(), touch_activity=False)
        store.update_session(entry.session_key, input_tokens=10, output_tokens=5,
                             estimated_cost_usd=0.5, cost_status="estimated",
                             last_prompt_tokens=99, touch_activity=False)  # fmt: skip
        store.update_session(entry.session_key, input_tokens=1, total_tokens=100,
                             cache_read_tokens=7, last_prompt_tokens=0)  # fmt: skip
        updated = store.lookup_by_session_key(entry.session_key)
        assert updated is not None
        assert (updated.input_tokens, updated.output_tokens, updated.total_tokens) == (11, 5, 115)
        assert (updated.cache_read_tokens, updated.last_prompt_tokens) == (7, 0)
        assert updated.estimated_cost_usd == pytest.approx(0.5)
        assert updated.cost_status == "estimated"
        assert updated.updated_at > entry.updated_at
        store.update_session("agent:main:telegram:dm:c=unknown", input_tokens=1)  # no-op

    def test_metadata(self, store: SessionStore) -> None:
        entry = store.get_or_create_session(telegram_dm(), touch_activity=False)
        value = {"nested": [1, 2]}
        assert store.set_session_metadata(entry.session_key, "state", value)
        value["nested"].append(3)  # the store keeps its own copy
        got = store.get_session_metadata(entry.session_key, "state")
        assert got == {"nested": [1, 2]}
        got["nested"].append(4)
        assert store.get_session_metadata(entry.session_key, "state") == {"nested": [1, 2]}
        assert store.get_session_metadata(entry.session_key, "missing", "dflt") == "dflt"
        with pytest.raises(InvalidValueError, match="not a JSON value"):
            store.set_session_metadata(entry.session_key, "bad", object())
        with pytest.raises(InvalidValueError, match="65536-byte limit"):
            store.set_session_metadata(entry.session_key, "big", "x" * 70_000)
        after = store.lookup_by_session_key(entry.session_key)
        assert after is not None
        assert after.updated_at == entry.updated_at
        assert set(after.metadata) == {"state"}
        assert not store.set_session_metadata("agent:main:telegram:dm:c=unknown", "a", 1)

    # -- lookups -----------------------------------------------------------------------------------

    def test_lookups_are_read_only(self, store: SessionStore) -> None:
        assert store.lookup_by_session_key("agent:main:telegram:dm:c=99") is None
        assert store.peek_session_id("agent:main:telegram:dm:c=99") is None
        assert store.lookup_by_session_key("") is None
        assert store.lookup_by_session_id("") is None
        entry = store.get_or_create_session(telegram_dm())
        found = store.lookup_by_session_id(entry.session_id)
        assert found is not None
        assert found.session_key == entry.session_key
        new = store.reset_session(entry.session_key)
        assert new is not None
        assert store.lookup_by_session_id(entry.session_id) is None  # matches the current id only
        assert store.peek_session_id(entry.session_key) == new.session_id

    def test_list_sessions_newest_first(self, store: SessionStore) -> None:
        for chat in ("1", "2", "3"):
            store.get_or_create_session(telegram_dm(chat))
        store.get_or_create_session(telegram_dm("1"))  # touch: newest again
        listed = [parse_session_key(entry.session_key).chat_id for entry in store.list_sessions()]
        assert listed == ["1", "3", "2"]
        assert len(store.list_sessions(active_minutes=5)) == 3

    def test_has_any_sessions_counts_two(self, store: SessionStore) -> None:
        assert not store.has_any_sessions()
        store.get_or_create_session(telegram_dm("1"))
        assert not store.has_any_sessions()
        store.get_or_create_session(telegram_dm("2"))
        assert store.has_any_sessions()

    # -- transcripts -------------------------------------------------------------------------------

    def test_transcript_round_trip(self, store: SessionStore) -> None:
        entry = store.get_or_create_session(telegram_dm())
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "héllo", "timestamp": 1.5, "platform_message_id": "m1"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "x"}]},
            {"role": "tool", "content": "result", "tool_call_id": "c1", "tool_name": "x",
             "custom": {"kept": True}},
        ]  # fmt: skip
        for message in messages:
            store.append_to_transcript(entry.session_id, message)
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "x"}, skip_db=True)
        loaded = store.load_transcript(entry.session_id)
        assert [m["role"] for m in loaded] == ["user", "assistant", "tool"]
        assert loaded[0]["content"] == "héllo"
        assert loaded[0]["timestamp"] == 1.5
        assert loaded[0]["platform_message_id"] == "m1"
        assert loaded[1]["tool_calls"] == [{"id": "c1", "name": "x"}]
        assert loaded[2]["custom"] == {"kept": True}
        assert loaded[2]["tool_name"] == "x"
        assert all(isinstance(m["timestamp"], float) for m in loaded)
        assert store.load_transcript("20200101_000000_00000000") == []

    def test_transcript_guards(self, store: SessionStore) -> None:
        with pytest.raises(InvalidValueError, match="session_id"):
            store.append_to_transcript("../escape", {"role": "user", "content": "x"})
        with pytest.raises(InvalidValueError, match="session_id"):
            store.load_transcript("a/../../b")

    # -- persistence and concurrency -------------------------------------------------------

    def test_state_survives_reopening(self, store_factory: StoreFactory, tmp_path: Path) -> None:
        state = tmp_path / "state"
        with store_factory(state) as first:
            entry = first.get_or_create_session(telegram_dm())
            first.append_to_transcript(entry.session_id, {"role": "user", "content": "kept"})
            token = first.mark_turn_active(entry.session_key)
            first.mark_resume_pending(entry.session_key, "restart_timeout")
        with store_factory(state) as second:
            again = second.lookup_by_session_key(entry.session_key)
            assert again is not None
            assert again.session_id == entry.session_id
            assert (again.active_turn_token, again.resume_pending) == (token, True)
            assert [m["content"] for m in second.load_transcript(entry.session_id)] == ["kept"]
            assert second.get_or_create_session(telegram_dm()).session_id == entry.session_id

    def test_racing_threads_create_one_session(self, store: SessionStore) -> None:
        barrier = threading.Barrier(8)
        results: list[str] = []
        errors: list[BaseException] = []

        def worker() -> None:
            barrier.wait()
            try:
                results.append(store.get_or_create_session(telegram_dm()).session_id)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert len(results) == 8
        assert len(set(results)) == 1
        assert not store.has_any_sessions()  # exactly one session row exists

    # -- marker recovery -----------------------------------------------------------------------

    def test_marker_recovery_after_a_crash(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        with store_factory(tmp_path / "state") as store:
            fresh = store.get_or_create_session(telegram_dm("1")).session_key
            kept = store.get_or_create_session(telegram_dm("2")).session_key
            paused = store.get_or_create_session(telegram_dm("3")).session_key
            for key in (fresh, kept, paused):
                store.mark_turn_active(key)
            store.mark_resume_pending(kept, "shutdown_timeout")
            store.suspend_session(paused)
        with store_factory(tmp_path / "state") as store:
            report = store._turns.recover_turn_markers(max_age_seconds=3600)
            assert (report.armed, report.kept, report.cleared) == ((fresh,), (kept,), 3)
            armed, held, suspended = map(store.lookup_by_session_key, (fresh, kept, paused))
            assert armed is not None
            assert (armed.resume_pending, armed.resume_reason) == (True, "restart_interrupted")
            assert held is not None
            assert held.resume_reason == "shutdown_timeout"
            assert suspended is not None
            assert not suspended.resume_pending
            assert store._turns.entries_with_fresh_markers(3600) == []

    def test_discarding_markers_arms_nothing(self, store: SessionStore) -> None:
        keys = [store.get_or_create_session(telegram_dm(c)).session_key for c in ("1", "2")]
        for key in keys:
            store.mark_turn_active(key)
        assert store._turns.discard_active_turn_markers() == 2
        for key in keys:
            entry = store.lookup_by_session_key(key)
            assert entry is not None
            assert (entry.active_turn_token, entry.resume_pending) == (None, False)
