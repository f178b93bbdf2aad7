"""The store's writer with several writer threads (one per writer connection, PostgreSQL)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import zlib
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.tcp_proxy import proxied

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL
from hermes_core import GatewayConfig
from hermes_core.domain.errors import GatewayLockedError, StoreUnavailableError
from hermes_core.store import SessionStore
from hermes_core.store.writer import StoreWriter
from hermes_core.testing import fresh_plugin_manager, telegram_dm

THREADS = 3


def _lanes_on_distinct_threads(count: int) -> list[str]:
    """Session keys that hash to ``count`` different writer threads of :data:`THREADS`."""
    found: dict[int, str] = {}
    number = 0
    while len(found) < count:
        key = f"agent:main:telegram:dm:c={number}"
        found.setdefault(zlib.crc32(key.encode()) % THREADS, key)
        number += 1
    return list(found.values())


def _writer(bound: list[tuple[int, str]] | None = None) -> StoreWriter:
    def transaction() -> AbstractContextManager[object]:
        return nullcontext()

    def bind(index: int) -> None:
        if bound is not None:
            bound.append((index, threading.current_thread().name))

    return StoreWriter(transaction, lambda: None, threads=THREADS, bind=bind)


def test_each_writer_thread_is_bound_to_its_own_connection() -> None:
    bound: list[tuple[int, str]] = []
    writer = _writer(bound)
    writer.close()
    assert sorted(index for index, _ in bound) == list(range(THREADS))
    assert len({name for _, name in bound}) == THREADS


async def test_one_lanes_steps_commit_in_the_order_handed_over() -> None:
    writer = _writer()
    seen: list[int] = []
    lane = "agent:main:telegram:dm:c=1"
    futures = [writer.submit(seen.append, number, lane=lane) for number in range(300)]
    await asyncio.gather(*futures)
    writer.close()
    assert seen == list(range(300))


async def test_steps_of_different_lanes_run_at_the_same_time() -> None:
    """A step of one lane waits for a step of another: only parallel threads let both end."""
    writer = _writer()
    first, second = _lanes_on_distinct_threads(2)
    started = threading.Event()

    def waits() -> bool:
        started.set()
        return meets.wait(5)

    meets = threading.Event()
    waiting = writer.submit(waits, lane=first)
    await asyncio.to_thread(started.wait, 5)
    await writer.arun(meets.set, lane=second)
    assert await waiting is True
    writer.close()


async def test_a_step_without_a_lane_runs_between_every_lanes_earlier_and_later_steps() -> None:
    writer = _writer()
    lanes = _lanes_on_distinct_threads(THREADS)
    log: list[str] = []

    def slow(tag: str) -> None:
        time.sleep(0.02)
        log.append(tag)

    before = [writer.submit(slow, f"before {n}", lane=lane) for n, lane in enumerate(lanes * 3)]
    snapshot = writer.submit(lambda: list(log))
    after = [writer.submit(slow, f"after {n}", lane=lane) for n, lane in enumerate(lanes * 3)]
    await asyncio.gather(*before, *after)
    seen = await snapshot
    writer.close()
    assert sorted(seen) == sorted(f"before {n}" for n in range(len(before)))
    assert writer.stats()["steps"] == len(before) + 1 + len(after)


@pytest.mark.parametrize("lock_order", [True, False])
async def test_a_batch_runs_in_lane_order_when_asked_each_lane_in_its_own_order(
    lock_order: bool,
) -> None:
    """With ``lock_order`` the steps a batch holds run sorted by lane (a lane's own steps, and
    a step without a lane against the rest, keep the order they were handed over in)."""

    def transaction() -> AbstractContextManager[object]:
        return nullcontext()

    writer = StoreWriter(transaction, lambda: None, lock_order=lock_order)
    started, release = threading.Event(), threading.Event()
    log: list[tuple[str | None, int]] = []

    def hold() -> None:
        started.set()
        release.wait(5)

    held = writer.submit(hold, lane="a")  # the next steps wait, then form one batch
    await asyncio.to_thread(started.wait, 5)
    handed = [("c", 1), ("b", 1), ("c", 2), (None, 1), ("b", 2), ("a", 1)]
    futures = [writer.submit(log.append, (lane, number), lane=lane) for lane, number in handed]
    release.set()
    await asyncio.gather(held, *futures)
    writer.close()
    assert writer.stats()["batches"] == 2  # the held step's, then the six together
    if lock_order:
        assert log == [("b", 1), ("c", 1), ("c", 2), (None, 1), ("a", 1), ("b", 2)]
    else:
        assert log == handed


@pytest.mark.slow
def test_steps_without_a_lane_handed_over_by_many_threads_at_once_all_run() -> None:
    """Each such step is put in every writer thread's queue; two put at the same time must
    reach every queue in the same order, or the threads wait at different steps' barriers
    for good (a start-up recovery in a worker thread beside the event loop's steps)."""
    writer = _writer()
    done: list[int] = []
    lock = threading.Lock()

    def step(number: int) -> None:
        with lock:
            done.append(number)

    def hand_over(first: int) -> None:
        for number in range(first, first + 500):
            writer.run(step, number)

    threads = [threading.Thread(target=hand_over, args=(n * 500,), daemon=True) for n in range(16)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often, inside a hand-over too
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
    stuck = sum(thread.is_alive() for thread in threads)
    assert stuck == 0, f"{stuck} threads still wait for their steps: the writer threads deadlocked"
    writer.close()
    assert sorted(done) == list(range(8000))


async def test_a_failing_step_fails_only_its_caller_on_its_lane() -> None:
    writer = _writer()
    lane = "agent:main:telegram:dm:c=7"

    def fails() -> None:
        raise ValueError("bad step")

    good = writer.submit(lambda: "kept", lane=lane)
    bad = writer.submit(fails, lane=lane)
    other = writer.submit(lambda: "other", lane="agent:main:telegram:dm:c=8")
    assert await good == "kept"
    with pytest.raises(ValueError, match="bad step"):
        await bad
    assert await other == "other"
    writer.close()


# -- PostgreSQL: every writer connection holds the writer lock -------------------------------------


def _open(url: str, home: Path) -> SessionStore:
    config = GatewayConfig.from_dict(
        {"storage": {"url": url, "writer_connections": THREADS}},
        environ={"HERMES_HOME": str(home)},
    )
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


def _holders(url: str) -> list[int]:
    """Server processes holding the writer lock."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objsubid = 2 AND objid = 1 "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        ).all()
    engine.dispose()
    return sorted(row[0] for row in rows)


def _terminate(url: str, pid: int) -> None:
    engine = create_engine(url)
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    engine.dispose()


def _write(store: SessionStore, lane: str, chat: str) -> None:
    """A write on ``lane``'s writer thread (so on its writer connection)."""
    store.run(store.get_or_create_session, telegram_dm(chat), lane=lane)


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_every_writer_connection_holds_the_lock_and_a_lost_one_comes_back(
    empty_database: str, tmp_path: Path
) -> None:
    lanes = _lanes_on_distinct_threads(THREADS)
    store = _open(empty_database, tmp_path / "a")
    try:
        for number, lane in enumerate(lanes):
            _write(store, lane, f"1{number}")
        holders = _holders(empty_database)
        assert len(holders) == THREADS
        # One writer connection lost: the others still hold the lock, so no one else writes;
        # the lost one's write is run again on a new connection that joins the lock.
        _terminate(empty_database, holders[-1])
        with pytest.raises(GatewayLockedError):
            _open(empty_database, tmp_path / "b")
        for number, lane in enumerate(lanes):
            _write(store, lane, f"2{number}")
        assert len(_holders(empty_database)) == THREADS
        assert store.health()["available"] is True
    finally:
        store.close()
    assert _holders(empty_database) == []


@pytest.mark.postgres
@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_a_lost_writer_connection_is_reopened_by_another_lanes_write(
    empty_database: str, tmp_path: Path
) -> None:
    """After an outage, a write of any lane reopens every connection found lost, so the store
    is whole again (and says so) while the lane that found the loss writes nothing."""
    first, second, _ = _lanes_on_distinct_threads(THREADS)
    with proxied(empty_database) as proxy:
        store = _open(proxy.url, tmp_path)
        try:
            _write(store, first, "1")
            _write(store, second, "2")
            proxy.down = True
            for pid in _holders(empty_database):
                _terminate(empty_database, pid)
            with pytest.raises(StoreUnavailableError):
                _write(store, first, "3")
            assert store.health()["available"] is False
            proxy.down = False
            deadline = time.monotonic() + 10
            while True:  # the first reconnect waits out the back-off
                try:
                    _write(store, second, "4")
                    break
                except StoreUnavailableError:
                    assert time.monotonic() < deadline, "the store never reconnected"
                    time.sleep(0.1)
            assert len(_holders(empty_database)) == 2  # the second lane's and the first's
            assert store.health()["available"] is True
        finally:
            store.close()
