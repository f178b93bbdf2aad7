"""The store contract kit's tests of the features a backend may offer (needs pytest, the
``test`` extra): search, transcript edits, pruning, the delivery ledger, durable queues, restart
counts in the store and maintenance. Each has a test of what it does and a ``*_without_*`` twin
checking what the store does where the backend does not declare it; the store's
``health()["capabilities"]`` decides which of the pair runs (the other is skipped).
:class:`~hermes_core.testing.store_contract.StoreContract` includes them."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from hermes_core.domain.errors import (
    InvalidValueError,
    MessageRedeliveredError,
    StoreUnavailableError,
    TranscriptWriteError,
    TurnInProgressError,
)
from hermes_core.domain.models import MessageEvent, SessionEntry
from hermes_core.state.instance import RESTART_COUNTS_FILE
from hermes_core.store import SessionStore
from hermes_core.store.backend import Message, Obligation
from hermes_core.store.base import KEY_SCHEMA_META
from hermes_core.store.replay import encode_message_line
from hermes_core.testing import telegram_dm
from hermes_core.testing.contract_base import ContractBase, StoreFactory


class FeatureContract(ContractBase):
    """What each optional feature does, or what the store does without it."""

    # -- search (capability "search") ---------------------------------------------------------

    def test_search_finds_active_messages(self, store: SessionStore) -> None:
        self.offers(store, "search")
        one = store.get_or_create_session(telegram_dm("1"))
        two = store.get_or_create_session(telegram_dm("2"))
        store.append_to_transcript(one.session_id, {"role": "user", "content": "blue whale"})
        store.append_to_transcript(two.session_id, {"role": "user", "content": "blue sky"})
        store.append_to_transcript(two.session_id, {"role": "assistant", "content": "grey"})
        assert {hit.session_id for hit in store.search("blue")} == {one.session_id, two.session_id}
        hits = store.search("blue", session_id=two.session_id)
        assert [(hit.session_id, hit.role) for hit in hits] == [(two.session_id, "user")]
        assert "blue" in hits[0].snippet
        assert store.search("whale", session_key=two.session_key) == []
        assert store.search("nowhere") == []

    def test_search_without_the_capability_finds_nothing(self, store: SessionStore) -> None:
        self.offers(store, "search", wanted=False)
        entry = store.get_or_create_session(telegram_dm())
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "needle"})
        assert store.search("needle") == []
        assert store.health()["fts"] == "unavailable"

    # -- transcript edits (capability "transcript_edits") ------------------------------------

    def test_rewrite_and_soft_delete(self, store: SessionStore) -> None:
        self.offers(store, "transcript_edits")
        entry = store.get_or_create_session(telegram_dm())
        for text in ("a", "b"):
            store.append_to_transcript(entry.session_id, {"role": "user", "content": text})
        token = store.mark_turn_active(entry.session_key)
        assert token is not None
        with pytest.raises(TurnInProgressError):
            store.rewrite_transcript(entry.session_id, [{"role": "user", "content": "x"}])
        new: list[Message] = [
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
        assert store.rewrite_transcript(entry.session_id, new, force=True) == 2
        loaded = store.load_transcript(entry.session_id)
        assert [m["content"] for m in loaded] == ["c", "d"]
        assert store.soft_delete_messages(entry.session_id, [loaded[0]["id"]]) == 1
        assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["d"]
        with pytest.raises(InvalidValueError):
            store.rewrite_transcript("20200101_000000_00000000", new)

    def test_edits_without_the_capability_change_nothing(self, store: SessionStore) -> None:
        self.offers(store, "transcript_edits", wanted=False)
        entry = store.get_or_create_session(telegram_dm())
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "keep"})
        with pytest.raises(TranscriptWriteError, match="nothing was changed"):
            store.rewrite_transcript(entry.session_id, [{"role": "user", "content": "x"}])
        with pytest.raises(TranscriptWriteError, match="nothing was changed"):
            store.soft_delete_messages(entry.session_id, [1])
        assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["keep"]

    # -- pruning (capability "pruning") -------------------------------------------------------

    def test_pruning_removes_idle_routes_only(self, store: SessionStore) -> None:
        self.offers(store, "pruning")
        idle = store.get_or_create_session(telegram_dm("1"))
        store.append_to_transcript(idle.session_id, {"role": "user", "content": "kept"})
        busy = store.get_or_create_session(telegram_dm("2"))
        store.mark_turn_active(busy.session_key)
        paused = store.get_or_create_session(telegram_dm("3"))
        store.suspend_session(paused.session_key)
        time.sleep(0.01)
        assert store.prune_old_entries(None) == 0
        assert store.prune_old_entries(0.001 / 86_400) == 1  # idle for more than a millisecond
        assert store.lookup_by_session_key(idle.session_key) is None
        assert store.lookup_by_session_key(busy.session_key) is not None
        assert store.lookup_by_session_key(paused.session_key) is not None
        back = store.get_or_create_session(telegram_dm("1"))  # the lane is rebuilt from its row
        assert back.session_id == idle.session_id
        assert [m["content"] for m in store.load_transcript(idle.session_id)] == ["kept"]

    def test_pruning_without_the_capability_removes_nothing(self, store: SessionStore) -> None:
        self.offers(store, "pruning", wanted=False)
        entry = store.get_or_create_session(telegram_dm())
        time.sleep(0.01)
        assert store.prune_old_entries(0.001 / 86_400) == 0
        assert store.lookup_by_session_key(entry.session_key) is not None

    # -- delivery ledger (capability "ledger") -------------------------------------------------

    def _record(self, store: SessionStore, token: str | None = None) -> Obligation | None:
        entry = store.get_or_create_session(telegram_dm())
        return store._turns.record_delivery_obligation(
            entry.session_key, entry.session_id, "telegram", "99", None, "the reply", "m1",
            turn_token=token, reply={"role": "assistant", "content": "the reply"},
        )  # fmt: skip

    def test_ledger_records_a_reply_and_clears_the_marker(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        with store_factory(tmp_path / "state") as store:
            self.offers(store, "ledger")
            entry = store.get_or_create_session(telegram_dm())
            token = store.mark_turn_active(entry.session_key)
            recorded = self._record(store, token)
            assert recorded is not None
            assert (recorded.state, recorded.content) == ("pending", "the reply")
            marked = store.lookup_by_session_key(entry.session_key)
            assert marked is not None
            assert marked.active_turn_token is None
            assert [m["content"] for m in store.load_transcript(entry.session_id)] == ["the reply"]
        with store_factory(tmp_path / "state") as again:
            ledger = again._obligations.ledger
            assert ledger is not None
            rows = ledger.rows.obligations(["pending"])
            assert [row.obligation_id for row in rows] == [recorded.obligation_id]
            ledger.rows.update_obligation(recorded.obligation_id, {"state": "delivered"})
            assert ledger.rows.obligations(["pending"]) == []
            ledger.rows.delete_obligation(recorded.obligation_id)
            assert ledger.rows.obligations(["delivered"]) == []

    def test_ledger_without_the_capability_is_unavailable(self, store: SessionStore) -> None:
        self.offers(store, "ledger", wanted=False)
        assert store._obligations.ledger is None
        assert self._record(store) is None
        assert store.health()["ledger"] == "unavailable"

    # -- durable queue (capability "queue") -----------------------------------------------------

    def test_queue_persists_events_and_dead_letters(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        event = MessageEvent(source=telegram_dm(), text="later", message_id="m7")
        with store_factory(tmp_path / "state") as store:
            self.offers(store, "queue")
            key = store.get_or_create_session(telegram_dm()).session_key
            first = store._queue.add(key, event)
            assert first is not None
            with pytest.raises(MessageRedeliveredError):
                store._queue.add(key, event)  # the platform delivered it again
            second = store._queue.add(key, MessageEvent(source=telegram_dm(), text="more"))
            assert second is not None
            assert store.health()["queue_persistent"] is True
        with store_factory(tmp_path / "state") as store:
            restored = store._queue.restore()
            assert [(i, k, e.text) for i, k, e in restored] == [
                (first, key, "later"), (second, key, "more"),
            ]  # fmt: skip
            attempts = store.config.gateway.max_dispatch_attempts
            assert [store._queue.fail(first, "boom") for _ in range(attempts)][-1] is True
            assert [(d.event_id, d.attempts, d.last_error) for d in store.dead_letters()] == [
                (first, attempts, "boom")
            ]
            assert [i for i, _, _ in store._queue.restore()] == [second]
            assert store._queue.remove([second]) == 1
            assert store._queue.restore() == []

    def test_queue_without_the_capability_is_memory_only(self, store: SessionStore) -> None:
        self.offers(store, "queue", wanted=False)
        key = store.get_or_create_session(telegram_dm()).session_key
        assert store._queue.add(key, MessageEvent(source=telegram_dm(), text="x")) is None
        assert (store._queue.restore(), store.dead_letters()) == ([], [])
        assert store.health()["queue_persistent"] is False

    # -- restart counts (in the store with "restart_counts", else a file) ---------------------

    def test_restart_counts_survive_reopening(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        with store_factory(tmp_path / "state") as store:
            store._counts.current.save({"lane:a": 2, "lane:b": 1})
            in_store = store.health()["capabilities"]["restart_counts"]
            counts_file = store.config.hermes_home / RESTART_COUNTS_FILE
        assert counts_file.exists() is not in_store
        with store_factory(tmp_path / "state") as store:
            assert store._counts.current.load() == {"lane:a": 2, "lane:b": 1}
            store._counts.current.remove("lane:a")
        with store_factory(tmp_path / "state") as store:
            assert store._counts.current.load() == {"lane:b": 1}

    # -- maintenance (capability "maintenance") ----------------------------------------------

    def test_maintenance_records_the_key_schema_and_imports(
        self, store: SessionStore, tmp_path: Path
    ) -> None:
        self.offers(store, "maintenance")
        maintenance = self.bound(store).maintenance
        assert maintenance is not None
        assert maintenance.get_meta(KEY_SCHEMA_META) == store.key_schema
        assert store.rekey(dry_run=True).schema_before == store.key_schema
        when = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
        imported = SessionEntry(
            session_key="agent:main:telegram:dm:c=5", session_id="20260301_120000_0a1b2c3d",
            created_at=when, updated_at=when, origin=telegram_dm("5"), platform="telegram",
            chat_type="dm",
        )  # fmt: skip
        path = tmp_path / "sessions.json"
        path.write_text(json.dumps({imported.session_key: imported.to_dict()}), encoding="utf-8")
        assert store.import_sessions_json(path) == 1
        assert store.import_sessions_json(path) == 0  # only keys the routing table lacks
        found = store.lookup_by_session_key(imported.session_key)
        assert found is not None
        assert found.session_id == imported.session_id
        backlog = store.config.sessions_dir / f"{imported.session_id}.jsonl"
        backlog.write_bytes(encode_message_line({"role": "user", "content": "while degraded"}))
        report = store._fallback.replay_backlog()
        assert report is not None
        assert report.messages_imported == 1
        assert not backlog.exists()
        assert [m["content"] for m in store.load_transcript(imported.session_id)] == [
            "while degraded"
        ]

    def test_without_maintenance_imports_and_rekeying_are_refused(
        self, store: SessionStore, tmp_path: Path
    ) -> None:
        self.offers(store, "maintenance", wanted=False)
        path = tmp_path / "sessions.json"
        path.write_text("{}", encoding="utf-8")
        with pytest.raises(StoreUnavailableError, match="nothing was changed"):
            store.import_sessions_json(path)
        with pytest.raises(StoreUnavailableError, match="nothing was changed"):
            store.rekey(dry_run=True)
        assert store._fallback.replay_backlog() is None
