"""Taking over a lane whose holder died or hung, on a shared PostgreSQL store, in one process:
each gateway or store below stands for a process of its own (its own ``$HERMES_HOME``, so its
own instance id)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from support.database import run_sql
from support.shared_driver import configure, leased

from hermes_core import MessageEvent, SessionSource
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import SessionEntry
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter, TurnRequest
from hermes_core.gateway.leased import LeasedOwnership
from hermes_core.gateway.lifecycle import Phase
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.store.backend import LeaseGrant, Locked
from hermes_core.turns.ledger import TAKEOVER_PREFIX
from hermes_core.turns.queue import TurnQueue

pytestmark = pytest.mark.postgres

T = TypeVar("T")
SHORT = 0.5
"""Seconds of a lease that is let expire."""


def _config(
    root: Path, name: str, url: str, lease_secs: float = SHORT, scan_secs: float = 3600
) -> GatewayConfig:
    """A process's settings; by default its scan runs rarely, so only what a test does takes
    lanes over."""
    return configure(root / name, url, lease_secs=lease_secs, scan_secs=scan_secs)


def _first(call: Callable[[], T | None], what: str, timeout: float = 10) -> T:
    """Call until the result is not None (or empty), then return it."""
    deadline = time.monotonic() + timeout
    while not (result := call()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return result


SOURCE = SessionSource(platform="telegram", chat_id="c1", chat_type="dm", user_id="c1")
OTHER = SessionSource(platform="telegram", chat_id="c2", chat_type="dm", user_id="c2")


@pytest.mark.slow
def test_a_grant_says_whether_it_replaced_a_lease_never_released(
    stores: Callable[..., SessionStore],
) -> None:
    holder, other = stores("holder"), stores("other")
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    assert other._leases.take_lease(key) is None  # held, unexpired
    grant = _first(lambda: other._leases.take_lease(key), "the holder's lease to expire")
    assert grant == "unreleased"  # the holder let it expire: a takeover
    assert other._leases.release_lease(key) is None
    assert holder._leases.take_lease(key) == "free"  # released: nothing to take over


@pytest.mark.slow
def test_a_lane_armed_to_resume_is_taken_over_when_its_holder_dies_before_resuming(
    stores: Callable[..., SessionStore],
) -> None:
    holder, other = stores("holder"), stores("other")
    dead, released = holder.session_key_for(SOURCE), holder.session_key_for(OTHER)
    for source in (SOURCE, OTHER):
        holder.get_or_create_session(source)
        key = holder.session_key_for(source)
        assert holder._leases.take_lease(key)
        assert holder.mark_resume_pending(key, "restart_interrupted")  # armed, no marker
    assert holder._leases.release_lease(released) is None  # its holder saw to its resume
    claimed = _first(
        lambda: other._leases.claim_orphaned_lanes(expired=True), "a lane to take over"
    )
    assert claimed == [dead]


def test_the_scan_leaves_a_lane_just_queued_to_its_enqueuer_and_claims_it_if_never_taken(
    stores: Callable[..., SessionStore],
) -> None:
    """A live process's enqueue commits before it takes the lane's lease: a scan in that gap
    must not take the lane over; an event left without a lease until the next scan (its
    enqueuer died) is claimed then."""
    enqueuer, scanner = stores("enqueuer"), stores("scanner")
    key = enqueuer.session_key_for(SOURCE)
    assert enqueuer._queue.add(key, MessageEvent(source=SOURCE, text="hi", message_id="m1"))
    assert (
        scanner._leases.claim_orphaned_lanes(expired=True) == []
    )  # the enqueuer is about to take it
    assert enqueuer._leases.take_lease(key) == "free"
    kept = enqueuer._leases.release_lease(key)  # the event waits: the enqueuer runs it
    assert isinstance(kept, list)
    assert [event.text for _, _, event in kept] == ["hi"]
    assert scanner._leases.claim_orphaned_lanes(expired=True) == []  # leased
    stranded = scanner.session_key_for(OTHER)
    assert scanner._queue.add(stranded, MessageEvent(source=OTHER, text="hi", message_id="m2"))
    assert enqueuer._leases.claim_orphaned_lanes(expired=True) == []
    assert enqueuer._leases.claim_orphaned_lanes(expired=True) == [
        stranded
    ]  # still unleased: claimed
    assert scanner._leases.take_lease(stranded) is None


def _lanes(store: SessionStore) -> LeasedOwnership:
    """The gateway's lease bookkeeping over ``store``, dispatching nothing."""

    async def take_over(key: str) -> None:
        """Nothing to take over in these tests."""

    return LeasedOwnership(
        store.config, store, TurnQueue(store, store.config), Phase(), dispatch=lambda key: None,
        take_over=take_over, running=lambda key: False, woken=lambda key: None,
    )  # fmt: skip


def _in_a_rolled_back_batch(
    store: SessionStore, key: str, step: Callable[..., T], *args: object
) -> T:
    """Run ``step(*args)`` as a writer step of lane ``key`` in one batch with a step that fails,
    so the batch is rolled back and the writer runs each step again on its own; the result of
    that second run."""

    async def run() -> T:
        started, go = threading.Event(), threading.Event()

        def hold() -> None:
            started.set()
            go.wait(10)

        def fail() -> None:
            raise RuntimeError("a neighbour's step fails")

        held = store.submit(hold, lane=key)
        await asyncio.to_thread(started.wait, 10)  # the next two queue up behind it: one batch
        result = store.submit(step, *args, lane=key)
        failed = store.submit(fail, lane=key)
        go.set()
        await held
        with pytest.raises(RuntimeError):
            await failed
        return await result

    return asyncio.run(run())


@pytest.mark.slow
def test_a_takeover_grant_rolled_back_with_its_batch_is_taken_again(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    holder, taker = stores("holder"), stores("taker")
    key = holder.session_key_for(SOURCE)
    assert holder._leases.take_lease(key) == "free"
    _first(lambda: _lease_expired(empty_database), "the holder's lease to expire")
    lanes = _lanes(taker)
    grant = _in_a_rolled_back_batch(taker, key, lanes._take_step, key)
    assert grant == "unreleased"  # not "being taken over here" after the rolled-back run
    assert taker._leases.holds(key)
    assert lanes.recovering(key)


@pytest.mark.slow
def test_lanes_claimed_in_a_rolled_back_batch_are_claimed_again(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    holder, taker = stores("holder"), stores("taker")
    key = holder.get_or_create_session(SOURCE).session_key
    assert holder._leases.take_lease(key)
    assert holder.mark_turn_active(key)  # a turn its holder never finishes
    _first(lambda: _lease_expired(empty_database), "the holder's lease to expire")
    lanes = _lanes(taker)
    assert _in_a_rolled_back_batch(taker, key, lanes._takeovers._claim_step) == [key]
    assert taker._leases.holds(key)
    assert lanes.recovering(key)


def test_a_scan_rolled_back_with_its_batch_does_not_count_as_a_scan(
    stores: Callable[..., SessionStore],
) -> None:
    """A lane only queued events make orphaned is claimed on the second scan that finds it
    unleased; a scan whose batch was rolled back must not count as the first."""
    enqueuer, scanner = stores("enqueuer"), stores("scanner")
    key = enqueuer.session_key_for(SOURCE)
    assert enqueuer._queue.add(key, MessageEvent(source=SOURCE, text="hi", message_id="m1"))
    scan = functools.partial(scanner._leases.claim_orphaned_lanes, expired=True)
    assert _in_a_rolled_back_batch(scanner, key, scan) == []  # left to its enqueuer
    assert scanner._leases.claim_orphaned_lanes(expired=True) == [key]  # the second scan claims it


@pytest.mark.slow
def test_leases_are_renewed_while_every_writer_thread_is_busy(
    stores: Callable[..., SessionStore],
) -> None:
    holder, other = stores("holder", lease_secs=2.0), stores("other", lease_secs=2.0)
    key = holder.get_or_create_session(SOURCE).session_key
    assert holder._leases.take_lease(key) == "free"

    async def scenario() -> list[LeaseGrant | Locked | None]:
        lanes = _lanes(holder)
        lanes.start()
        started, go = threading.Event(), threading.Event()

        def hold() -> None:
            started.set()
            go.wait(10)

        busy = holder.submit(hold)  # no lane: every writer thread waits until it ends
        await asyncio.to_thread(started.wait, 10)
        grants = []
        deadline = time.monotonic() + 4.0  # twice the lease
        while time.monotonic() < deadline:
            grants.append(await asyncio.to_thread(other._leases.take_lease, key))
            await asyncio.sleep(0.2)
        go.set()
        await busy
        await asyncio.to_thread(holder.mark_turn_active, key)  # fenced: the lease still holds
        await lanes.stop()
        return grants

    grants = asyncio.run(scenario())
    assert len(grants) > 10
    assert not {"free", "unreleased"} & set(grants)  # never granted elsewhere


class Held(EchoAgent):
    """Echoes once ``release`` is set (a hung process's turn); ``started`` is set meanwhile."""

    def __init__(self, release: asyncio.Event, started: asyncio.Event) -> None:
        super().__init__()
        self.release = release
        self.started = started

    async def run_turn(self, request: TurnRequest) -> str | None:
        self.started.set()
        await self.release.wait()
        return await super().run_turn(request)


def _gateway(
    root: Path, name: str, url: str, agent: Callable[[], EchoAgent], lease_secs: float = SHORT,
    scan_secs: float = 3600,
) -> tuple[Gateway, InMemoryAdapter]:  # fmt: skip
    config = _config(root, name, url, lease_secs, scan_secs)
    adapter = InMemoryAdapter(platform="telegram")

    def agents(entry: SessionEntry) -> EchoAgent:
        return agent()

    return Gateway(config, None, agents, [adapter]), adapter


def _message(words: str, message_id: str) -> MessageEvent:
    return MessageEvent(text=words, source=SOURCE, message_id=message_id)


def _lease_expired(url: str) -> bool:
    """Whether the one lease in the store has expired (on the server's clock)."""
    [(expired,)] = run_sql(
        url,
        "SELECT bool_and(expires_at < extract(epoch from clock_timestamp())) "
        "FROM session_turn_leases",
    )
    return bool(expired)


async def _wait(condition: Callable[[], bool], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("first_takeover", ["works", "fails"])
def test_a_message_for_a_hung_holders_lane_first_resumes_the_cut_turn(
    tmp_path: Path, empty_database: str, first_takeover: str
) -> None:
    failures: list[str] = []

    def recover_after_a_failure(recover: Callable[[str], None], key: str) -> None:
        if not failures:
            failures.append(key)
            raise RuntimeError("the takeover's recovery failed")
        recover(key)

    async def scenario() -> list[str]:
        release, started = asyncio.Event(), asyncio.Event()
        hung, _ = _gateway(tmp_path, "hung", empty_database, lambda: Held(release, started))
        scan = 0.2 if first_takeover == "fails" else 3600  # a lane let go is found again
        taker, adapter = _gateway(tmp_path, "taker", empty_database, EchoAgent, scan_secs=scan)
        await hung.start()
        await taker.start()
        if first_takeover == "fails":  # the lane is let go, then taken over again
            ownership = leased(taker)
            recover = functools.partial(recover_after_a_failure, ownership.recover)
            ownership.recover = recover  # type: ignore[method-assign]
        await hung.handle_message(_message("first", "m1"))
        await started.wait()
        await leased(hung).stop()  # it hangs: its lease is no longer renewed
        await _wait(lambda: _lease_expired(empty_database), "the hung holder's lease to expire")
        await taker.handle_message(_message("second", "m2"))
        await _wait(lambda: len(adapter.sent) >= 2, "both answers")
        await taker.idle()
        release.set()  # its turn ends; its reply is fenced off
        await hung.stop()
        await taker.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: first", "echo: second"]
    assert len(failures) == (first_takeover == "fails")


def _sending(holder: SessionStore) -> None:
    """``holder`` takes the lease of SOURCE's lane and has claimed a reply it is sending."""
    entry = holder.get_or_create_session(SOURCE)
    key = entry.session_key
    assert holder._leases.take_lease(key)
    holder._turns.record_delivery_obligation(
        key, entry.session_id, "telegram", "c1", None, "being sent right now", "m1",
        claimed=True,
    )  # fmt: skip


@pytest.mark.slow
def test_a_starting_gateway_leaves_the_owed_replies_of_lanes_held_elsewhere_alone(
    tmp_path: Path, empty_database: str, stores: Callable[..., SessionStore]
) -> None:
    _sending(stores("holder", lease_secs=60))  # alive, sending the reply

    async def scenario() -> list[str]:
        gateway, adapter = _gateway(tmp_path, "other", empty_database, EchoAgent)
        await gateway.start()
        await gateway.idle()
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == []


@pytest.mark.slow
def test_a_scan_takeover_racing_a_message_for_the_lane_still_resumes_the_cut_turn(
    tmp_path: Path, empty_database: str
) -> None:
    """The scan claims a hung holder's lane just before a message for it arrives here: the
    message's lane task is still taking the lease (its step, after the claim, only queues the
    message) when the takeover starts. The takeover waits for it, then resumes the cut turn
    before the message runs (it used to take the task for a turn of its own and skip the
    recovery, so the cut turn was never answered)."""

    async def scenario() -> list[str]:
        release, started = asyncio.Event(), asyncio.Event()
        hung, _ = _gateway(tmp_path, "hung", empty_database, lambda: Held(release, started))
        taker, adapter = _gateway(tmp_path, "taker", empty_database, EchoAgent)
        await hung.start()
        await taker.start()
        await hung.handle_message(_message("first", "m1"))
        await started.wait()
        shared = leased(taker)
        await leased(hung).stop()  # it hangs: its lease is no longer renewed
        await _wait(lambda: _lease_expired(empty_database), "the hung holder's lease to expire")
        opening = shared.open

        async def slow_open(*args: object, **kwargs: object) -> object:
            opened = await opening(*args, **kwargs)  # type: ignore[arg-type]
            await asyncio.sleep(0.3)  # a loaded loop: the lane task resumes late
            return opened

        shared.open = slow_open  # type: ignore[assignment,method-assign]
        claim = asyncio.ensure_future(taker.store.arun(shared._takeovers._claim_step))  # a scan
        message = asyncio.ensure_future(taker.handle_message(_message("second", "m2")))
        taken = await claim
        assert taken == [taker.store.session_key_for(SOURCE)]
        await shared._takeovers.recover_lanes(taken)  # as the scan goes on
        await message
        await _wait(lambda: len(adapter.sent) >= 2, "both answers")
        await taker.idle()
        release.set()
        await hung.stop()
        await taker.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == ["echo: first", "echo: second"]


class Resumes(EchoAgent):
    """Echoes, noting each internal (resumed) turn's lane."""

    def __init__(self, resumed: list[str]) -> None:
        super().__init__()
        self.resumed = resumed

    async def run_turn(self, request: TurnRequest) -> str | None:
        if request.event.internal:
            self.resumed.append(request.session_key)
        return await super().run_turn(request)


@pytest.mark.slow
def test_a_clean_start_resumes_a_turn_another_process_left_on_a_lane_without_a_lease(
    tmp_path: Path, empty_database: str
) -> None:
    """A gateway that stopped cleanly starts again and claims a lane with a turn marker and no
    lease (here left by a single-instance gateway that died before the switch to shared
    mode): that marker is not its own to discard; the cut turn is resumed."""
    resumed: list[str] = []
    gateway, _ = _gateway(tmp_path, "b", empty_database, lambda: Resumes(resumed), lease_secs=30)

    async def run_once() -> None:
        await gateway.start()
        await gateway.idle()
        await gateway.stop()

    asyncio.run(run_once())  # its stop is clean
    single = GatewayConfig.from_dict(
        {"storage": {"url": empty_database}}, environ={"HERMES_HOME": str(tmp_path / "single")}
    )
    with SessionStore.open(single) as dead:
        key = dead.get_or_create_session(SOURCE).session_key
        assert dead.mark_turn_active(key)  # its turn was running when it died
    gateway, _ = _gateway(tmp_path, "b", empty_database, lambda: Resumes(resumed), lease_secs=30)

    async def start_again() -> None:
        await gateway.start()
        await _wait(lambda: bool(resumed), "the cut turn to resume")
        await gateway.idle()
        await gateway.stop()

    asyncio.run(start_again())
    assert resumed == [key]
    assert run_sql(empty_database, "SELECT count(*) FROM gateway_routing WHERE "
                   "active_turn_token IS NOT NULL OR resume_pending <> 0") == [(0,)]  # fmt: skip


@pytest.mark.slow
def test_a_reply_re_sent_after_a_takeover_says_another_gateway_took_over(
    tmp_path: Path, empty_database: str, stores: Callable[..., SessionStore]
) -> None:
    """The holder was sending a reply when it stopped responding (its lease expired): the
    taker re-sends it marked, saying what happened; nothing restarted."""
    _sending(stores("holder"))

    async def scenario() -> list[str]:
        gateway, adapter = _gateway(tmp_path, "taker", empty_database, EchoAgent, scan_secs=0.2)
        await gateway.start()
        await _wait(lambda: bool(adapter.sent), "the re-sent reply")
        await gateway.idle()
        await gateway.stop()
        return adapter.texts()

    assert asyncio.run(scenario()) == [f"{TAKEOVER_PREFIX}\n\nbeing sent right now"]
