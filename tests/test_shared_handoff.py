"""A lane's turn path on a shared PostgreSQL store, in one process: each gateway or store below
stands for a process of its own (its own ``$HERMES_HOME``, so its own instance id). An idle
lane's message takes the lease and begins its turn before it is acknowledged; a message for a
lane leased elsewhere is only queued; the turn's writes are fenced; a release and a concurrent
enqueue never strand the event. How many statements and commits each step takes is the
performance contract, tests/test_perf_contract.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.database import run_sql
from support.shared_driver import configure
from test_shared_takeover import (
    OTHER,
    SOURCE,
    Held,
    _first,
    _gateway,
    _message,
    _wait,
)

from hermes_core import MessageEvent, SessionSource
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import LeaseLostError
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.store.backend import LOCKED, LeaseGrant, Locked, Obligation
from hermes_core.store.queue_rows import QueuedEvent
from hermes_core.turns.ledger import SendResult
from hermes_core.turns.queue import TurnQueue

pytestmark = pytest.mark.postgres

LONG = 60.0
"""Seconds of a lease that does not expire during a test."""


def _scalar(url: str, sql: str) -> object:
    [(value,)] = run_sql(url, sql)
    return value


QUEUE_ROWS_EVER = "SELECT pg_sequence_last_value(pg_get_serial_sequence('queued_events', 'id'))"
"""The last queued-event id drawn (NULL: no queue row was ever written)."""


@pytest.mark.slow
def test_an_idle_lanes_message_takes_the_lease_and_begins_its_turn(
    tmp_path: Path, empty_database: str
) -> None:
    async def scenario() -> list[str]:
        release, started = asyncio.Event(), asyncio.Event()
        gateway, adapter = _gateway(
            tmp_path, "solo", empty_database, lambda: Held(release, started), lease_secs=LONG
        )
        await gateway.start()
        store = gateway.store
        key = store.session_key_for(SOURCE)
        await gateway.handle_message(_message("hi", "m1"))
        assert store._leases.holds(key)
        marker = f"SELECT active_turn_token FROM gateway_routing WHERE session_key = '{key}'"
        assert _scalar(empty_database, marker) is not None  # begun before it returned
        await started.wait()
        await gateway.handle_message(_message("hi", "m1"))  # delivered again: ignored
        release.set()
        await _wait(lambda: bool(adapter.sent), "the reply")
        await gateway.idle()
        await _wait(lambda: not store._leases.holds(key), "the lease to be released")
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: hi"]
    assert _scalar(empty_database, QUEUE_ROWS_EVER) is None  # never queued, never dequeued
    assert _scalar(empty_database, "SELECT count(*) FROM session_turn_leases") == 0


@pytest.mark.slow
def test_a_message_for_a_lane_leased_elsewhere_is_queued_and_run_by_the_holder(
    tmp_path: Path, empty_database: str
) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        release, started = asyncio.Event(), asyncio.Event()
        holder, held = _gateway(
            tmp_path, "holder", empty_database, lambda: Held(release, started), lease_secs=LONG
        )
        other, elsewhere = _gateway(tmp_path, "other", empty_database, EchoAgent, lease_secs=LONG)
        await holder.start()
        await other.start()
        await holder.handle_message(_message("first", "m1"))
        await started.wait()
        await other.handle_message(_message("second", "m2"))
        queued = "SELECT count(*) FROM queued_events"
        assert _scalar(empty_database, queued) == 1  # stored before it returned
        assert not other.store._leases.holds(other.store.session_key_for(SOURCE))
        release.set()
        await _wait(lambda: len(held.sent) == 2, "both replies")
        await holder.idle()
        await _wait(lambda: not holder.store._leases.held_lanes(), "the lease to be released")
        await holder.stop()
        await other.stop()
        return held.texts(), elsewhere.texts()

    assert asyncio.run(scenario()) == (["echo: first", "echo: second"], [])


@pytest.mark.slow
def test_an_event_waiting_without_a_lease_runs_before_the_message_that_takes_it(
    tmp_path: Path, empty_database: str, stores: Callable[..., SessionStore]
) -> None:
    """Another process queued an event and is about to take the lease: the message that takes
    it here queues behind that event instead of beginning at once."""
    enqueuer = stores("enqueuer", lease_secs=LONG)
    key = enqueuer.session_key_for(SOURCE)

    async def scenario() -> list[str]:
        gateway, adapter = _gateway(tmp_path, "taker", empty_database, EchoAgent, lease_secs=LONG)
        await gateway.start()
        assert enqueuer._queue.add(key, _message("first", "m1"))
        await gateway.handle_message(_message("second", "m2"))
        await _wait(lambda: len(adapter.sent) == 2, "both replies")
        await gateway.idle()
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: first", "echo: second"]


def _held_open(store: SessionStore, key: str, work: Callable[[], object]) -> Callable[[], None]:
    """Run ``work`` in a writer step of ``key`` (another thread) whose transaction then stays
    open; returns the call that lets it commit (and waits for that)."""
    done, commit = threading.Event(), threading.Event()

    def step() -> None:
        work()
        done.set()
        commit.wait(10)

    holding = threading.Thread(target=store.run, args=(step,), kwargs={"lane": key}, daemon=True)
    holding.start()
    assert done.wait(10)

    def committed() -> None:
        commit.set()
        holding.join(10)

    return committed


def _while_held_open(
    store: SessionStore, key: str, work: Callable[[], object]
) -> Callable[[Callable[[], object]], object]:
    """:func:`_held_open`; returns the call that checks ``call`` waits for that transaction,
    lets it commit and returns what ``call`` returned."""
    commit = _held_open(store, key, work)

    def waits_for_commit(call: Callable[[], object]) -> object:
        result: list[object] = []
        calling = threading.Thread(target=lambda: result.append(call()), daemon=True)
        calling.start()
        calling.join(0.5)
        assert calling.is_alive()  # it waits for the open transaction
        commit()
        calling.join(10)
        return result[0]

    return waits_for_commit


def test_a_release_meeting_a_grant_in_progress_waits_for_nothing_and_then_keeps_the_lease(
    stores: Callable[..., SessionStore],
) -> None:
    """The refused grant keeps the lease row locked until the enqueue commits: a release then
    decides nothing and does not wait (the writer's other lanes would wait behind it); tried
    again after the commit, it sees the event and keeps the lease."""
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    refused: list[object] = []

    def enqueue_under_the_grant() -> None:
        with enqueuer._backing.transaction():
            refused.append(enqueuer._leases.take_idle_lease(key))
            enqueuer._queue.add(key, _message("hi", "m1"))

    commit = _held_open(enqueuer, key, enqueue_under_the_grant)
    started = time.monotonic()
    assert holder._leases.release_lease(key) == LOCKED
    assert time.monotonic() - started < 1.0
    assert holder._leases.holds(key)
    commit()
    kept = holder._leases.release_lease(key)
    assert refused == [None]
    assert isinstance(kept, list)  # kept: the event waits and the holder runs it
    assert [event.text for _, _, event in kept] == ["hi"]
    assert holder._leases.holds(key)


def test_a_refused_grant_that_queued_nothing_does_not_keep_the_lease_held(
    stores: Callable[..., SessionStore],
) -> None:
    """A grant refused while the lane is held marks the lease row as waiting (the caller may be
    queueing an event); with nothing queued, the holder's release still lets the lane go."""
    holder, other = stores("holder", lease_secs=LONG), stores("other", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    assert other._leases.take_lease(key) is None  # refused, nothing queued
    assert holder._leases.release_lease(key) is None
    assert not holder._leases.holds(key)
    assert other._leases.take_lease(key) == "free"


def test_a_release_after_an_event_was_queued_under_a_refused_grant_keeps_the_lease(
    stores: Callable[..., SessionStore],
) -> None:
    """Committed before the release began: the release sees the event, keeps the lease, and the
    next one (once the event ran) lets the lane go."""
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.get_or_create_session(SOURCE).session_key
    assert holder._leases.take_lease(key) == "free"

    def enqueue_under_the_grant() -> int | None:
        with enqueuer._backing.transaction():
            assert enqueuer._leases.take_idle_lease(key) is None
            return enqueuer._queue.add(key, _message("hi", "m1"))

    event_id = enqueuer.run(enqueue_under_the_grant, lane=key)
    assert event_id is not None
    kept = holder._leases.release_lease(key)
    assert isinstance(kept, list)
    assert [(queued, event.text) for queued, _, event in kept] == [(event_id, "hi")]
    assert holder._leases.holds(key)
    assert holder.mark_turn_active(key, consumed_event_id=event_id)  # the event runs, dequeued
    assert holder._leases.release_lease(key) is None
    assert enqueuer._leases.take_lease(key) == "free"


def test_an_enqueuer_meeting_a_release_in_progress_finds_the_lane_free_once_it_commits(
    stores: Callable[..., SessionStore],
) -> None:
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    released: list[object] = []
    commit = _held_open(holder, key, lambda: released.append(holder._leases.release_lease(key)))
    assert enqueuer._leases.take_idle_lease(key) == LOCKED  # nothing waited for, nothing marked
    commit()
    taken = enqueuer._leases.take_idle_lease(key)
    assert released == [None]
    assert taken == ("free", False)  # the lane is the enqueuer's: it runs its event itself


@pytest.mark.slow
def test_a_renewal_while_a_grant_is_uncommitted_leaves_that_lease_alone(
    stores: Callable[..., SessionStore],
) -> None:
    """The renewal's connection cannot see the row yet; it must not count the lease lost (the
    process would stop renewing and never release it, and the turn's writes would fail)."""
    holder, other = stores("holder", lease_secs=LONG), stores("other", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    waits_for_commit = _while_held_open(holder, key, lambda: holder._leases.take_lease(key))
    assert holder._leases.renew_leases() == []
    assert waits_for_commit(lambda: other._leases.take_lease(key)) is None  # held by the holder
    assert holder._leases.holds(key)
    assert holder._leases.renew_leases() == []  # renewed, now that it is committed
    assert holder._leases.release_lease(key) is None
    assert other._leases.take_lease(key) == "free"


@pytest.mark.slow
def test_a_grant_after_a_release_in_progress_sees_what_the_release_committed_with_it(
    stores: Callable[..., SessionStore],
) -> None:
    """Tried while the release is uncommitted, the grant does nothing; tried again after, it
    reads the entry the release committed, not the one cached."""
    holder, taker = stores("holder", lease_secs=LONG), stores("taker", lease_secs=LONG)
    old = taker.get_or_create_session(SOURCE)  # cached by the taker, at the row's revision
    key = old.session_key
    assert holder._leases.take_lease(key) == "free"

    def new_and_release() -> None:  # /new and the release, in one commit
        assert holder.reset_session(key) is not None
        assert holder._leases.release_lease(key) is None

    commit = _held_open(holder, key, new_and_release)
    assert taker._leases.take_lease(key) == LOCKED
    commit()
    assert taker._leases.take_lease(key) == "free"
    entry, new = taker.lookup_by_session_key(key), holder.lookup_by_session_key(key)
    assert entry is not None
    assert new is not None
    assert entry.session_id == new.session_id != old.session_id


@pytest.mark.slow
def test_a_turns_start_and_finish_write_nothing_once_the_lease_is_lost(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    first, second = stores("first"), stores("second")
    entry = first.get_or_create_session(SOURCE)
    key = entry.session_key
    assert first._leases.take_lease(key)
    token = first.mark_turn_active(key, None, {"role": "user", "content": "hi"}, seen="m1")
    assert token is not None
    _first(lambda: second._leases.take_lease(key), "the first store's lease to expire")
    with pytest.raises(LeaseLostError):
        first._turns.record_delivery_obligation(
            key, entry.session_id, "telegram", "c1", None, "echo: hi", "m1", turn_token=token,
            claimed=True, reply={"role": "assistant", "content": "echo: hi"},
        )  # fmt: skip
    assert not first._leases.holds(key)
    assert _scalar(empty_database, "SELECT count(*) FROM delivery_obligations") == 0
    assert _scalar(empty_database, "SELECT count(*) FROM messages") == 1  # the user's only

    other = first.get_or_create_session(OTHER).session_key
    assert first._leases.take_lease(other)
    _first(lambda: second._leases.take_lease(other), "the first store's lease to expire")
    with pytest.raises(LeaseLostError):
        first.mark_turn_active(other, None, {"role": "user", "content": "yo"}, seen="m2")
    routing = f"SELECT active_turn_token FROM gateway_routing WHERE session_key = '{other}'"
    assert _scalar(empty_database, routing) is None
    assert _scalar(empty_database, "SELECT count(*) FROM messages") == 1
    assert _scalar(empty_database, "SELECT count(*) FROM seen_messages") == 1  # m1's only


def _turn_with_reply(store: SessionStore, words: str, message_id: str) -> Obligation:
    """A turn of ``store`` under its lease: begun, its reply stored and recorded, claimed."""
    entry = store.get_or_create_session(SOURCE)
    key = entry.session_key
    token = store.mark_turn_active(key, None, {"role": "user", "content": words}, seen=message_id)
    assert token is not None
    reply = f"echo: {words}"
    row = store._turns.record_delivery_obligation(
        key, entry.session_id, "telegram", "c1", None, reply, message_id, turn_token=token,
        claimed=True, reply={"role": "assistant", "content": reply},
    )  # fmt: skip
    assert row is not None
    return row


@pytest.mark.parametrize("sent", [True, False], ids=["delivered", "failed"])
def test_a_turns_settle_releases_the_lease(
    stores: Callable[..., SessionStore], empty_database: str, sent: bool
) -> None:
    """A delivered reply's ledger row is deleted with the lease row; a failed send is recorded
    as failed and the lease goes all the same."""
    holder, other = stores("holder", lease_secs=LONG), stores("other", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    row = _turn_with_reply(holder, "hi", "m1")
    result = SendResult(ok=True) if sent else SendResult(ok=False, failure_kind="rejected")
    kept: list[object] = []
    settle = functools.partial(
        holder._turns.settle_delivery, row, result, (key, None), kept=kept.append
    )
    assert holder.run(settle, lane=key) is sent  # one writer step, as a gateway runs it
    assert kept == []
    assert not holder._leases.holds(key)
    ledger = "SELECT count(*) FROM delivery_obligations WHERE state = 'failed'"
    assert _scalar(empty_database, ledger) == (0 if sent else 1)
    assert _scalar(empty_database, "SELECT count(*) FROM delivery_obligations") == int(not sent)
    assert other._leases.take_lease(key) == "free"


def test_a_turns_settle_keeps_the_lease_for_an_event_queued_under_a_refused_grant(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    """The release folded into the settle decides as the release alone does: the event another
    process queued keeps the lease here (the reply's row goes all the same)."""
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    row = _turn_with_reply(holder, "hi", "m1")

    def enqueue_under_the_grant() -> int | None:
        with enqueuer._backing.transaction():
            assert enqueuer._leases.take_idle_lease(key) is None
            return enqueuer._queue.add(key, _message("again", "m2"))

    event_id = enqueuer.run(enqueue_under_the_grant, lane=key)
    assert event_id is not None
    kept: list[list[QueuedEvent]] = []
    assert holder._turns.settle_delivery(row, SendResult(ok=True), (key, None), kept=kept.append)
    assert [[(queued, event.text) for queued, _, event in events] for events in kept] == [
        [(event_id, "again")]
    ]  # the event came with the settle that kept the lease
    assert holder._leases.holds(key)  # kept: the holder runs the event
    assert _scalar(empty_database, "SELECT count(*) FROM delivery_obligations") == 0
    assert enqueuer._leases.take_lease(key) is None


class FollowingUp(InMemoryAdapter):
    """Sends a follow-up message to the gateway from inside the send of the first reply, so it
    arrives before that reply's settle is stored."""

    gateway: Gateway | None = None
    follow_up: MessageEvent | None = None

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        result = await super().send(source, text, reply_to=reply_to)
        follow_up, self.follow_up = self.follow_up, None
        if follow_up is not None and self.gateway is not None:
            await self.gateway.handle_message(follow_up)
        return result


@pytest.mark.slow
def test_a_message_arriving_before_the_last_turns_settle_runs_and_the_lane_goes_free(
    tmp_path: Path, empty_database: str
) -> None:
    """A lane's lease is given up in its last turn's settle; a message stored before that
    settle (the lane still busy) or after it is answered all the same, and the lane ends free."""

    async def scenario() -> list[str]:
        config = configure(tmp_path / "solo", empty_database, lease_secs=LONG, scan_secs=3600)
        adapter = FollowingUp(platform="telegram")
        gateway = Gateway(config, None, lambda entry: EchoAgent(), [adapter])
        adapter.gateway = gateway
        await gateway.start()
        store = gateway.store
        key = store.session_key_for(SOURCE)
        adapter.follow_up = _message("second", "m2")
        await gateway.handle_message(_message("first", "m1"))
        await _wait(lambda: len(adapter.sent) == 2, "both replies")
        await gateway.idle()
        await _wait(lambda: not store._leases.holds(key), "the lease to be released")
        await gateway.handle_message(_message("third", "m3"))
        await _wait(lambda: len(adapter.sent) == 3, "the third reply")
        await gateway.idle()
        await _wait(lambda: not store._leases.holds(key), "the lease to be released again")
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: first", "echo: second", "echo: third"]
    assert _scalar(empty_database, "SELECT count(*) FROM session_turn_leases") == 0
    assert _scalar(empty_database, "SELECT count(*) FROM queued_events") == 0
    assert _scalar(empty_database, "SELECT count(*) FROM delivery_obligations") == 0


def _two_lanes_on_one_writer_thread(store: SessionStore) -> tuple[str, str]:
    """Two session keys, in ascending order, that every writer of up to 8 threads runs on the
    same thread (so their steps can share a batch)."""
    seen: dict[int, str] = {}
    for number in range(10_000):
        source = SessionSource(platform="telegram", chat_id=f"d{number}", chat_type="dm")
        key = store.session_key_for(source)
        slot = zlib.crc32(key.encode()) % 840  # divisible by every count of threads up to 8
        if slot in seen:
            first, second = sorted((seen[slot], key))
            return first, second
        seen[slot] = key
    raise AssertionError("no two keys share a writer thread")


@pytest.mark.slow
def test_two_processes_taking_two_lanes_in_opposite_orders_do_not_deadlock(
    stores: Callable[..., SessionStore],
) -> None:
    """Each process's batch takes the same two leases, handed over in opposite orders, while the
    other's batch is open. Run as handed over, each would hold one row and wait for the other
    (the database fails one batch after its deadlock timeout, and its steps run again one by
    one); run in lane order, the second process waits for the first's commit and is refused."""
    first, second = stores("first", lease_secs=LONG), stores("second", lease_secs=LONG)
    low, high = _two_lanes_on_one_writer_thread(first)
    overlapping = threading.Event()

    async def batch(store: SessionStore, order: list[str], pause: str) -> list[object]:
        started, release = threading.Event(), threading.Event()

        def gate() -> None:
            started.set()
            release.wait(10)

        def between() -> None:  # the first process waits here for the second's first take
            if pause == "wait":
                overlapping.wait(1.5)
            else:
                overlapping.set()

        gated = store.submit(gate, lane=order[0])
        await asyncio.to_thread(started.wait, 10)
        steps: list[asyncio.Future[LeaseGrant | Locked | None] | asyncio.Future[None]] = [
            store.submit(store._leases.take_lease, order[0], lane=order[0]),
            store.submit(between, lane=order[0]),
            store.submit(store._leases.take_lease, order[1], lane=order[1]),
        ]
        release.set()
        await gated
        return [await step for step in steps]

    async def scenario() -> tuple[list[object], list[object]]:
        before = first.stats()["batches"], second.stats()["batches"]
        taking = asyncio.create_task(batch(first, [low, high], "wait"))
        await asyncio.sleep(0.2)  # the first batch holds the lower lane's row
        refused = await batch(second, [high, low], "signal")
        taken = await taking
        after = first.stats()["batches"], second.stats()["batches"]
        assert [b - a for a, b in zip(before, after, strict=True)] == [2, 2]  # gate and batch
        return taken, refused

    taken, refused = asyncio.run(scenario())
    assert taken == ["free", None, "free"]
    assert refused == [None, None, None]
    assert first._leases.holds(low)
    assert first._leases.holds(high)


@pytest.mark.slow
def test_an_unreadable_queued_event_is_set_aside_and_the_lane_goes_free(
    tmp_path: Path, empty_database: str, stores: Callable[..., SessionStore]
) -> None:
    """An event no process here can read (its payload is not a message event) would keep the
    lane's lease held for ever, the holder releasing and keeping it in a loop: it becomes a
    dead letter, with the reason, and the lane is released once its readable events ran."""
    enqueuer = stores("enqueuer", lease_secs=LONG)
    key = enqueuer.session_key_for(SOURCE)
    run_sql(
        empty_database,
        "INSERT INTO queued_events (session_key, internal, event_json, enqueued_at, updated_at)"
        f" VALUES ('{key}', 0, '{{\"not\": \"an event\"}}', 0, 0)",
    )

    async def scenario() -> tuple[list[str], int]:
        gateway, adapter = _gateway(tmp_path, "taker", empty_database, EchoAgent, lease_secs=LONG)
        await gateway.start()
        store = gateway.store
        await gateway.handle_message(_message("hi", "m1"))
        await _wait(lambda: bool(adapter.sent), "the reply")
        await gateway.idle()
        await _wait(lambda: not store._leases.holds(key), "the lease to be released")
        before = store.stats()["round_trips"]
        await asyncio.sleep(0.3)
        spent = store.stats()["round_trips"] - before
        await gateway.stop()
        return adapter.texts(), spent

    texts, spent = asyncio.run(scenario())
    assert texts == ["echo: hi"]
    assert spent == 0  # no loop of releases
    [letter] = enqueuer.dead_letters()
    assert letter.session_key == key
    assert "cannot be read" in (letter.last_error or "")
    assert _scalar(empty_database, "SELECT count(*) FROM session_turn_leases") == 0


def test_a_lease_released_while_the_renewal_runs_is_not_counted_lost(
    stores: Callable[..., SessionStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewal takes the held tokens, then renews them; a lane released in between is gone
    from the table but was given up, not lost to another gateway (which the caller warns of)."""
    holder = stores("holder", lease_secs=LONG)
    keys = [holder.session_key_for(SOURCE), holder.session_key_for(OTHER)]
    for key in keys:
        assert holder._leases.take_lease(key) == "free"
    rows = holder._backing.bound.leases
    assert rows is not None
    renew = rows.renew_leases

    def release_first(tokens: Sequence[str], ttl: float) -> set[str]:
        assert (
            holder._leases.release_lease(keys[0]) is None
        )  # committed before the renewal's statement
        return renew(tokens, ttl)

    monkeypatch.setattr(rows, "renew_leases", release_first)
    assert holder._leases.renew_leases() == []
    assert not holder._leases.holds(keys[0])
    assert holder._leases.holds(keys[1])


@pytest.mark.slow
def test_a_grant_that_waited_for_another_insert_still_runs_its_full_lease(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    """Another process's grant of the same new lane is uncommitted (its row is not in the
    statement's snapshot, so the insert waits for it); once it commits, expired, the grant
    takes the lane, and its lease counts from then, not from before the wait."""
    lease = 4.0
    holder = stores("holder", lease_secs=lease)
    key = holder.session_key_for(SOURCE)
    engine = create_engine(empty_database)
    try:
        with engine.connect() as conn:
            conn.execute(text(
                "INSERT INTO session_turn_leases (session_key, owner_instance, owner_boot, token,"
                " acquired_at, expires_at) VALUES (:key, 'gone', 'gone', 'gone', 0, 1)"
            ), {"key": key})  # fmt: skip
            granting = threading.Thread(target=holder._leases.take_lease, args=(key,), daemon=True)
            granting.start()
            granting.join(0.8)
            assert granting.is_alive()  # waits for the uncommitted insert
            conn.commit()
            granting.join(10)
    finally:
        engine.dispose()
    rows = run_sql(empty_database, "SELECT owner_instance, expires_at - extract(epoch from "
                   "clock_timestamp()) FROM session_turn_leases")  # fmt: skip
    assert [row[0] for row in rows] == [holder._leases.owner[0]]
    assert rows[0][1] > lease - 0.5  # a full lease from the grant, not from before the wait


@pytest.mark.slow
def test_a_settle_after_a_takeover_leaves_the_reply_s_ledger_row_to_the_new_holder(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    """The holder's lease expired and another process took the lane over while the reply was
    being sent: the settle's ledger-row delete checks the token, so the row stays for the new
    holder (which re-sends it marked) instead of vanishing under it."""
    holder, taker = stores("holder"), stores("taker")
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    row = _turn_with_reply(holder, "hi", "m1")
    grant = _first(lambda: taker._leases.take_lease(key), "the holder's lease to expire")
    assert grant == "unreleased"
    settle = functools.partial(
        holder._turns.settle_delivery, row, SendResult(ok=True), (key, None),
        kept=lambda events: None,
    )  # fmt: skip
    holder.run(settle, lane=key)
    assert _scalar(empty_database, "SELECT count(*) FROM delivery_obligations") == 1
    assert taker._leases.holds(key)


def test_a_burst_split_by_another_processs_event_runs_in_acknowledged_order(
    stores: Callable[..., SessionStore], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The holder merges a follow-up into its queued message, while another process queued an
    event between the two: reloaded, the lane runs the three in the order they were stored,
    the follow-up on its own, and nothing is reported lost."""
    holder, other = stores("holder", lease_secs=LONG), stores("other", lease_secs=LONG)
    key = holder.get_or_create_session(SOURCE).session_key
    assert holder._leases.take_lease(key) == "free"
    bursts = {"gateway": {"busy_queue": {"burst_window_secs": 60}}}
    queue = TurnQueue(
        holder, GatewayConfig.from_dict(bursts, environ={"HERMES_HOME": str(tmp_path)})
    )
    assert queue.enqueue(key, _message("first", "m1")).accepted
    assert other._queue.add(key, _message("between", "m2"))  # under a refused grant elsewhere
    assert queue.enqueue(key, _message("follow-up", "m3")).merged
    with caplog.at_level(logging.WARNING):
        assert holder.run(queue.reload, key, lane=key) == 3
    assert [item.event.text for item in queue.items(key)] == ["first", "between", "follow-up"]
    assert not [record for record in caplog.records if "lost its item" in record.message]
