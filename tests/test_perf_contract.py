"""The performance contract: how many exchanges with the database each step of the turn path
spends, held exactly.

On a shared PostgreSQL store a turn's latency and the server's load are mostly these exchanges,
so a change that adds one to the turn path fails here, on purpose; if it is worth its cost, the
new count goes into the table with the reason. Each operation's behaviour is tested where it
lives (the last column); here only its count. The counters are ``SessionStore.stats()``:
``statements`` and ``commits`` on the writer's connections, routing and session-row reads, and
``round_trips`` = statements + commits + 2 x reads (a pooled read ends with a rollback).

=========================================================  ======  ==========  =====  ============
Operation                                                  Store   Counter     Count  Behaviour in
=========================================================  ======  ==========  =====  ============
an idle lane's message: lease taken, turn begun, acked     shared  commits     1      handoff
a release with nothing waiting (the delete, its commit)    shared  round trips 2      handoff
a release kept for an event queued under a refused grant   shared  round trips 2      handoff
  (the event comes with the keep)
a settle, reply delivered: ledger row and lease go         shared  statements  1      handoff
  together                                                         commits     1
a settle, send failed: failure recorded, then the lease    shared  statements  2      handoff
  goes                                                             commits     1
a settle that keeps the lease for an event queued          shared  statements  1      handoff
  elsewhere (the event comes with it)
a message's turn on a free lane: grant, start, reply,      shared  round trips 7      handoff
  settle with release (4 statements in 3 commits)
a new lane opened: its routing row read (absent), its      SQLite  statements  4      sql_store
  newest session row read (none), both rows written        PG                  3
  (one statement on PostgreSQL)
a queued event with its platform message id (the           SQLite  statements  2      sql_store
  redelivery check)                                        PG                  1
a lane not cached here, loaded with its session's end      both    statements  1      sql_store
a lease taken again, nothing changed: the cached entry     shared  row reads   0      routing
  is kept
a lease taken again after another process started a new    shared  row reads   0      routing
  session, wrote metadata or counters: the entry comes
  with the grant
=========================================================  ======  ==========  =====  ============

"shared" is ``storage.instances: shared`` on PostgreSQL (skipped without
``HERMES_TEST_POSTGRES_URL``); "both" runs on SQLite and PostgreSQL. "Behaviour in" names the
module ``tests/test_shared_handoff.py``, ``tests/test_sql_store.py`` or
``tests/test_shared_routing.py``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_shared_handoff import LONG, _turn_with_reply
from test_shared_routing import _one_turn
from test_shared_takeover import SOURCE, Held, _gateway, _message, _wait

from hermes_core import EchoAgent, MessageEvent
from hermes_core.store import SessionStore
from hermes_core.testing import telegram_dm
from hermes_core.turns.ledger import SendResult

Opener = Callable[[], SessionStore]


def _counting_reads(monkeypatch: pytest.MonkeyPatch, store: SessionStore) -> list[str]:
    """The routing and session rows the store reads from now on (by method name)."""
    reads: list[str] = []
    backend = store._backing.backend
    for name in ("read_route", "get_session"):
        method = getattr(backend, name)

        def counted(*args: Any, _name: str = name, _method: Any = method) -> Any:
            reads.append(_name)
            return _method(*args)

        monkeypatch.setattr(backend, name, counted)
    return reads


def _on_sqlite(settings: dict[str, Any]) -> bool:
    return "storage" not in settings


def _spent(store: SessionStore, counter: str, call: Callable[[], object]) -> tuple[int, object]:
    """How much of ``counter`` ``call`` spent, and what it returned."""
    before = store.stats()[counter]
    result = call()
    return store.stats()[counter] - before, result


# -- the shared store's turn path ----------------------------------------------------------------


@pytest.mark.postgres
def test_an_idle_lanes_message_is_acknowledged_after_one_commit(
    tmp_path: Path, empty_database: str
) -> None:
    async def scenario() -> int:
        release, started = asyncio.Event(), asyncio.Event()
        gateway, adapter = _gateway(
            tmp_path, "solo", empty_database, lambda: Held(release, started), lease_secs=LONG
        )
        await gateway.start()
        before = gateway.store.stats()["commits"]
        await gateway.handle_message(_message("hi", "m1"))
        spent = gateway.store.stats()["commits"] - before
        release.set()
        await _wait(lambda: bool(adapter.sent), "the reply")
        await gateway.idle()
        await gateway.stop()
        return spent

    assert asyncio.run(scenario()) == 1


@pytest.mark.postgres
def test_a_release_with_nothing_waiting_is_one_statement(
    stores: Callable[..., SessionStore],
) -> None:
    holder = stores("holder", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    spent, released = _spent(holder, "round_trips", lambda: holder._leases.release_lease(key))
    assert released is None
    assert not holder._leases.holds(key)
    assert spent == 2  # the delete and its commit


def _queued_under_a_refused_grant(enqueuer: SessionStore, key: str, words: str, mid: str) -> None:
    """Another process's grant is refused (the lane is held here), and it queues its event."""

    def enqueue() -> int | None:
        with enqueuer._backing.transaction():
            assert enqueuer._leases.take_idle_lease(key) is None
            return enqueuer._queue.add(key, _message(words, mid))

    assert enqueuer.run(enqueue, lane=key) is not None


@pytest.mark.postgres
def test_a_release_kept_for_a_waiting_event_brings_the_event_with_it(
    stores: Callable[..., SessionStore],
) -> None:
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.get_or_create_session(SOURCE).session_key
    assert holder._leases.take_lease(key) == "free"
    _queued_under_a_refused_grant(enqueuer, key, "hi", "m1")
    spent, kept = _spent(holder, "round_trips", lambda: holder._leases.release_lease(key))
    assert isinstance(kept, list)
    assert [event.text for _, _, event in kept] == ["hi"]
    assert spent == 2  # the event came with the keep


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("sent", "statements"), [(True, 1), (False, 2)], ids=["delivered", "failed"]
)
def test_a_turns_settle_with_its_release_is_one_commit(
    stores: Callable[..., SessionStore], sent: bool, statements: int
) -> None:
    """Delivered: the ledger row and the lease row go in one statement; failed: the failure is
    recorded first, then the lease goes. One commit either way."""
    holder = stores("holder", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    row = _turn_with_reply(holder, "hi", "m1")
    result = SendResult(ok=True) if sent else SendResult(ok=False, failure_kind="rejected")
    kept: list[object] = []
    settle = functools.partial(
        holder._turns.settle_delivery, row, result, (key, None), kept=kept.append
    )
    before = holder.stats()
    assert holder.run(settle, lane=key) is sent  # one writer step, as a gateway runs it
    after = holder.stats()
    assert kept == []
    assert not holder._leases.holds(key)
    assert after["statements"] - before["statements"] == statements
    assert after["commits"] - before["commits"] == 1


@pytest.mark.postgres
def test_a_settle_that_keeps_the_lease_is_one_statement(
    stores: Callable[..., SessionStore],
) -> None:
    holder, enqueuer = stores("holder", lease_secs=LONG), stores("enqueuer", lease_secs=LONG)
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    row = _turn_with_reply(holder, "hi", "m1")
    _queued_under_a_refused_grant(enqueuer, key, "again", "m2")
    kept: list[object] = []
    settle = functools.partial(holder._turns.settle_delivery, row, SendResult(ok=True), (key, None))
    spent, delivered = _spent(holder, "statements", lambda: settle(kept=kept.append))
    assert delivered
    assert len(kept) == 1  # the event came with the statement that kept the lease
    assert holder._leases.holds(key)
    assert spent == 1


@pytest.mark.postgres
def test_a_messages_turn_on_a_free_lane_is_seven_round_trips(
    tmp_path: Path, empty_database: str
) -> None:
    """The grant, the start, the reply, the settle with the release: four statements, in three
    commits (the grant and the start share one)."""

    async def scenario() -> int:
        gateway, adapter = _gateway(tmp_path, "solo", empty_database, EchoAgent, lease_secs=LONG)
        await gateway.start()
        store = gateway.store
        key = store.session_key_for(SOURCE)

        async def turn(words: str, message_id: str) -> None:
            replies = len(adapter.sent) + 1
            await gateway.handle_message(_message(words, message_id))
            await _wait(lambda: len(adapter.sent) == replies, f"the reply to {words}")
            await gateway.idle()
            await _wait(lambda: not store._leases.holds(key), "the lease to be released")

        await turn("first", "m1")
        before = store.stats()["round_trips"]
        await turn("second", "m2")
        spent = store.stats()["round_trips"] - before
        await gateway.stop()
        return spent

    assert asyncio.run(scenario()) == 7


# -- opening lanes and queueing, on each backend --------------------------------------------------


def test_a_new_lane_reads_its_routing_row_once(
    open_store: Opener, settings: dict[str, Any]
) -> None:
    """Its routing row (absent) and newest session row (none) are read and both rows written,
    the routing row not read a second time; PostgreSQL writes the two rows in one statement."""
    store = open_store()
    source = telegram_dm("1")
    key = store.session_key_for(source)
    spent, _ = _spent(store, "statements", lambda: store._sessions.open_lane(key, source))
    assert spent == (4 if _on_sqlite(settings) else 3)


def test_a_queued_event_and_its_message_id_are_one_statement_on_postgresql(
    open_store: Opener, settings: dict[str, Any]
) -> None:
    store = open_store()
    key = store.session_key_for(telegram_dm("1"))
    event = MessageEvent(source=telegram_dm("1"), text="queued", message_id="m1")
    spent, event_id = _spent(store, "statements", lambda: store._queue.add(key, event))
    assert event_id is not None
    assert spent == (2 if _on_sqlite(settings) else 1)


def test_a_lane_not_cached_is_loaded_in_one_statement(open_store: Opener) -> None:
    """Its session's end comes with the routing row, not from a second read of the session
    row."""
    first = open_store()
    entry = first.get_or_create_session(telegram_dm("1"))
    first.close()
    store = open_store()
    source = telegram_dm("1")
    spent, _ = _spent(
        store, "statements", lambda: store._sessions.open_lane(entry.session_key, source)
    )
    assert spent == 1


# -- leases taken again on the shared store -------------------------------------------------------


@pytest.mark.postgres
def test_a_lease_taken_again_reads_no_entry_nothing_changed(
    stores: Callable[..., SessionStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant reads the routing row's revision: the cached entry is still it, kept."""
    store = stores("here", lease_secs=60)
    key = store.get_or_create_session(SOURCE).session_key
    _one_turn(store, key)
    reads = _counting_reads(monkeypatch, store)
    _one_turn(store, key)
    assert reads == []


@pytest.mark.postgres
@pytest.mark.parametrize("change", ["new", "metadata", "counters"])
def test_a_lease_taken_again_after_a_change_elsewhere_reads_no_entry(
    stores: Callable[..., SessionStore], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The entry another process wrote comes with the grant, read in its statement."""
    here, there = stores("here", lease_secs=60), stores("there", lease_secs=60)
    key = here.get_or_create_session(SOURCE).session_key
    _one_turn(here, key)  # the entry stays cached here, at the row's revision
    if change == "new":
        assert there.reset_session(key) is not None
    elif change == "metadata":
        assert there.set_session_metadata(key, "topic", "theirs")
    else:
        there.update_session(key, input_tokens=7)
    reads = _counting_reads(monkeypatch, here)
    assert here._leases.take_lease(key)
    assert here.lookup_by_session_key(key) is not None
    assert reads == []
