"""The store contract kit's tests of the capabilities that decide how the store runs on a
backend (needs pytest, the ``test`` extra): atomic write batches, turn leases (stores shared by
several gateways), parallel writers, lane wake-ups, local state and the operator interface. Each
is tested on the protocol the backend implements for it, or on what the store does with it; most
have a ``*_without_*`` twin, and the store's ``health()["capabilities"]`` decides which of the
pair runs. :class:`~hermes_core.testing.store_contract.StoreContract` includes them.

A store shared by several gateways (``turn_leases``) writes a turn only under the lane's lease,
which the required tests do not take: run :class:`DeploymentContract` alone on a store opened
shared, and the whole kit on one opened for one gateway."""

from __future__ import annotations

import queue
import secrets
import threading
import time
from pathlib import Path

import pytest

from hermes_core.domain.models import MessageEvent
from hermes_core.store import SessionStore
from hermes_core.store.backend import LeaseTaken
from hermes_core.store.mirror import read_mirror
from hermes_core.store.operator import Held
from hermes_core.testing import telegram_dm
from hermes_core.testing.contract_base import DM_KEY, ContractBase, StoreFactory


class _Abandoned(Exception):
    """Raised inside a writer step to abandon it."""


class DeploymentContract(ContractBase):
    """What each capability changes in how the store runs, or what it does without it."""

    # -- atomic write batches (capability "atomic_batches") ----------------------------------

    def _rename_then_fail(self, store: SessionStore) -> str | None:
        """One writer step that renames the lane in its stored entry and then fails; the
        lane's display name stored afterwards."""
        entry = store.get_or_create_session(telegram_dm(chat_name="before"))
        backend = self.bound(store).backend
        renamed = entry.model_copy(update={"display_name": "after"}).to_dict()

        def step() -> None:
            with store._backing.transaction():
                backend.put_route(renamed)
                raise _Abandoned

        with pytest.raises(_Abandoned):
            store.run(step, lane=entry.session_key)
        stored = backend.get_route(entry.session_key)
        assert stored is not None
        name: str | None = stored["display_name"]
        return name

    def test_atomic_batches_roll_back_a_failed_step(self, store: SessionStore) -> None:
        self.offers(store, "atomic_batches")
        assert self._rename_then_fail(store) == "before"

    def test_without_atomic_batches_each_write_stands(self, store: SessionStore) -> None:
        self.offers(store, "atomic_batches", wanted=False)
        assert self._rename_then_fail(store) == "after"

    # -- turn leases (capability "turn_leases") -----------------------------------------------

    def test_turn_leases_have_one_holder_at_a_time(self, store: SessionStore) -> None:
        self.offers(store, "turn_leases")
        leases = self.bound(store).leases
        assert leases is not None
        key = store.get_or_create_session(telegram_dm()).session_key
        mine, theirs = secrets.token_hex(16), secrets.token_hex(16)

        def take(owner: str, token: str) -> object:
            return store.run(leases.take_lease, key, owner, f"{owner}-boot", token, 60.0, lane=key)

        assert isinstance(take("a", mine), LeaseTaken)
        assert take("b", theirs) is None  # another boot holds it
        assert store.run(leases.check_lease, key, mine, lane=key)
        assert not store.run(leases.check_lease, key, theirs, lane=key)
        assert leases.renew_leases([mine, theirs], 60.0) == {mine}
        assert store.run(leases.release_lease, key, mine, lane=key) is None  # nothing queued
        assert isinstance(take("b", theirs), LeaseTaken)
        assert leases.give_up_leases([theirs]) == []
        queued = store._queue.add(key, MessageEvent(source=telegram_dm(), text="waiting"))
        assert queued is not None
        assert (key, queued) in leases.orphaned_lanes("c", "c-boot", False, 60.0)  # no lease
        routed = leases.read_route(key)
        assert routed is not None
        assert routed[0]["session_key"] == key

    def test_without_turn_leases_one_store_holds_every_lane(self, store: SessionStore) -> None:
        self.offers(store, "turn_leases", wanted=False)
        assert not store.shared
        assert store._leases.holds(store.get_or_create_session(telegram_dm()).session_key)

    # -- parallel writers (capability "parallel_writers") -------------------------------------

    def test_parallel_writers_commit_lanes_side_by_side(self, store: SessionStore) -> None:
        self.offers(store, "parallel_writers")
        writers = self.bound(store).writers
        assert writers is not None
        assert writers.writer_connections() >= 1
        barrier = threading.Barrier(8)

        def lane(chat: str) -> None:
            barrier.wait()
            entry = store.get_or_create_session(telegram_dm(chat))
            store.append_to_transcript(entry.session_id, {"role": "user", "content": chat})

        threads = [threading.Thread(target=lane, args=(str(chat),)) for chat in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for chat in range(8):
            entry = store.lookup_by_session_key(f"agent:main:telegram:dm:c={chat}")
            assert entry is not None
            assert [m["content"] for m in store.load_transcript(entry.session_id)] == [str(chat)]

    # -- lane wake-ups (capability "lane_wakeups", with "turn_leases") ------------------------

    def test_lane_wakeups_reach_a_listener(self, store: SessionStore) -> None:
        self.offers(store, "turn_leases")
        self.offers(store, "lane_wakeups")
        wakeups = self.bound(store).wakeups
        assert wakeups is not None
        woken: queue.Queue[str] = queue.Queue()
        stop = wakeups.listen_lanes(woken.put)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the listener starts on a thread of its own
                store.run(wakeups.wake_lane, DM_KEY)
                try:
                    assert woken.get(timeout=0.2) == DM_KEY
                    break
                except queue.Empty:
                    continue
            else:
                pytest.fail("no wake-up reached the listener within 10 s")
        finally:
            stop()

    def test_without_lane_wakeups_nothing_listens(self, store: SessionStore) -> None:
        self.offers(store, "lane_wakeups", wanted=False)
        assert store._leases.listen_lanes(lambda key: None) is None

    # -- local state (capability "local_state") -----------------------------------------------

    def _mirrored(self, store_factory: StoreFactory, home: Path, wanted: bool) -> Path:
        """Open a store, skip unless its offer of ``local_state`` is ``wanted``, add a lane and
        close it: the path of its sessions.json."""
        with store_factory(home) as store:
            self.offers(store, "local_state", wanted=wanted)
            store.get_or_create_session(telegram_dm())
            path: Path = store.config.sessions_dir / "sessions.json"
        return path

    def test_local_state_writes_the_sessions_json_mirror(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        path = self._mirrored(store_factory, tmp_path / "state", wanted=True)
        assert list(read_mirror(path)) == [DM_KEY]

    def test_without_local_state_no_mirror_is_written(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        path = self._mirrored(store_factory, tmp_path / "state", wanted=False)
        assert not path.exists()

    # -- operator interface (capability "operator") -------------------------------------------

    def test_operator_interface_reads_and_checks_the_records(self, store: SessionStore) -> None:
        self.offers(store, "operator")
        operator = self.bound(store).operator
        assert operator is not None
        entry = store.get_or_create_session(telegram_dm())
        store.append_to_transcript(entry.session_id, {"role": "user", "content": "hello"})
        kinds = operator.record_kinds()
        assert {kinds.sessions, kinds.routes, *kinds.export} <= set(kinds.transfer)
        routes = operator.table_rows(kinds.routes, None, 10)
        assert [(row["session_key"], row["session_id"]) for row in routes] == [
            (entry.session_key, entry.session_id)
        ]
        assert operator.table_rows(kinds.routes, operator.primary_key(kinds.routes, routes[0]),
                                   10) == []  # fmt: skip
        first = operator.primary_key(kinds.routes, routes[0])
        assert operator.span_end(kinds.routes, None, 1) == first  # spans of export --jobs
        assert operator.span_end(kinds.routes, None, 2) is None
        assert operator.table_rows(kinds.routes, None, 10, first) == routes
        sessions = operator.table_rows(kinds.sessions, None, 10)
        assert [(row["id"], row["message_count"]) for row in sessions] == [(entry.session_id, 1)]
        changed = {**routes[0], "session_id": "another"}
        lacked = {**routes[0], "session_key": "agent:main:another"}
        assert operator.held_rows(kinds.routes, routes) == Held(same=1, other=0)
        assert operator.held_rows(kinds.routes, [changed, lacked]) == Held(same=0, other=1)
        digest = operator.table_digest(kinds.routes)
        assert digest.rows == 1
        assert operator.table_digest(kinds.routes) == digest
        assert operator.integrity_problems() == []
        checks = operator.check_routes(None, 10)
        assert (checks.sessions, checks.unreadable, checks.dangling) == (
            [(entry.session_key, entry.session_id)],
            [],
            [],
        )
        assert operator.check_routes(entry.session_key, 10).sessions == []
        assert operator.unreadable_events() == []
        assert operator.obligation_counts() == {}
