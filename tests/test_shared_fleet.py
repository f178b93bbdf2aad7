"""Real gateway processes on one PostgreSQL database (``storage.instances: shared``): what one
process that freezes, stops or restarts costs the others' lanes, and the order of one lane's
messages handed to alternating processes."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.gateway_driver import read_lines
from support.shared_driver import Fleet, event

from hermes_core.gateway.texts import NEW_SESSION, QUEUED_COMMAND

pytestmark = [pytest.mark.postgres, pytest.mark.multi_process, pytest.mark.slow]


def _query(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [tuple(row) for row in conn.execute(text(sql))]
    engine.dispose()
    return rows


def _acked(fleet: Fleet, count: int) -> bool:
    return len(fleet.acked()) == count


def _answered_at(fleet: Fleet, message_id: str) -> float | None:
    """When the first reply to ``message_id`` was sent (wall clock), or None."""
    times = [float(line["t"]) for line in fleet.sent() if line["reply_to"] == message_id]
    return min(times) if times else None


def test_a_frozen_process_inside_a_transaction_stalls_only_its_own_lanes(
    tmp_path: Path, empty_database: str
) -> None:
    """``a`` stops (SIGSTOP) inside an open writer transaction that holds its lanes' lease rows
    locked. ``b`` and ``c`` keep answering their own lanes at once, while messages for ``a``'s
    lanes reach ``b``; those wait about one lease and are then answered by the others."""
    lease = 8.0
    fleet = Fleet(tmp_path, empty_database, lease_secs=lease, think=(2.0, 2.0))
    for name in ("a", "b", "c"):
        fleet.start(name)
    first = [event(f"a{n}", f"a{n} first", f"a{n}-0") for n in range(3)]
    fleet.deliver("a", first)
    fleet.wait_for(
        lambda: sum(line["kind"] == "start" for line in fleet.turns()) == len(first),
        "a's turns to start",
    )
    frozen = fleet.freeze("a")
    assert len(frozen) == len(first)  # a holds its three lanes' rows locked, frozen
    try:
        states = _query(empty_database, "SELECT state FROM pg_stat_activity")
        assert ("idle in transaction",) in states  # a's transaction stays open
        for_a = [event(f"a{n}", f"a{n} second", f"a{n}-1") for n in range(3)]
        own = {"b": [event(f"b{n}", f"b{n}", f"b{n}-0") for n in range(3)],
               "c": [event(f"c{n}", f"c{n}", f"c{n}-0") for n in range(3)]}  # fmt: skip
        sent = time.time()
        fleet.deliver("b", for_a + own["b"])  # b's writer meets a's locked rows first
        fleet.deliver("c", own["c"])
        theirs = own["b"] + own["c"]
        fleet.wait_for(lambda: not fleet.unanswered(theirs), "b's and c's lanes", 60)
        slowest = max(_answered_at(fleet, str(item["message_id"])) or 0.0 for item in theirs)
        # a turn thinks 2 s; a stalled writer waited for a's rows until a lock timed out
        assert slowest - sent < lease / 2, f"b's and c's lanes waited {slowest - sent:.1f} s"
        fleet.wait_for(lambda: not fleet.unanswered(for_a), "a's lanes, taken over", 90)
        later = min(_answered_at(fleet, str(item["message_id"])) or 0.0 for item in for_a)
        assert later - sent >= lease / 2  # a's own lanes waited for a's lease to expire
        names = {line["name"] for line in fleet.sent() if line["reply_to"] in
                 {str(item["message_id"]) for item in for_a}}  # fmt: skip
        assert "a" not in names
    finally:
        process = fleet.children["a"]
        if process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)
    fleet.stop_all()


def test_a_process_frozen_right_after_queueing_for_a_held_lane_stalls_none_of_the_holders_lanes(
    tmp_path: Path, empty_database: str
) -> None:
    """``a`` queues a message for a lane ``b`` holds (its refused grant marks the lane's lease
    row, locked until its transaction ends) and stops (SIGSTOP) inside that open transaction,
    while ``b``'s turn on the lane runs. ``b`` finishes that turn (its fenced write does not
    wait for ``a``'s lock) and answers its other lanes at once; once the database has ended
    ``a``'s transaction and ``a`` goes on, the message it had queued is answered once."""
    lease = 40.0
    fleet = Fleet(tmp_path, empty_database, lease_secs=lease, think=(2.0, 2.0))
    fleet.start("a")
    fleet.start("b")
    held = event("x", "x first", "x-0")
    fleet.deliver("b", [held])
    fleet.wait_for(lambda: any(line["kind"] == "start" for line in fleet.turns()), "b's turn")
    touched = event("x", "x second", "x-1")
    frozen = fleet.freeze_queueing("a", touched)
    frozen_sessions = (  # application_name starts with the instance id (see storage.md)
        "SELECT 1 FROM pg_stat_activity WHERE state = 'idle in transaction' "
        f"AND application_name LIKE 'hermes {fleet.instance('a')} %'"
    )
    thawed = False
    try:
        assert frozen["queued"]  # b holds the lane: a queued the message, marking the row
        own = [event(f"b{n}", f"b{n}", f"b{n}-0") for n in range(3)]
        sent = time.time()
        fleet.deliver("b", own)
        fleet.wait_for(lambda: not fleet.unanswered([held, *own]), "b's lanes", 60)
        slowest = max(_answered_at(fleet, str(item["message_id"])) or 0.0 for item in own)
        # a turn thinks 2 s; b's writer waited for a's row lock until the database ended a's
        # transaction, a quarter lease (10 s) after the freeze
        assert slowest - sent < lease / 8, f"b's other lanes waited {slowest - sent:.1f} s"
        assert _query(empty_database, frozen_sessions)  # a's transaction stays open
        fleet.wait_for(
            lambda: not _query(empty_database, frozen_sessions),
            "the database to end a's frozen transaction", 60,
        )  # fmt: skip
        fleet.thaw("a")
        thawed = True
        fleet.wait_for(lambda: not fleet.unanswered([touched]), "the message a queued", 60)
    finally:
        if not thawed:
            fleet.thaw("a")
        fleet.stop_all()
    assert fleet.answers([held, touched, *own]) == {
        str(item["message_id"]): (1, 0) for item in (held, touched, *own)
    }


def test_one_lanes_messages_through_alternating_processes_run_in_acknowledged_order(
    tmp_path: Path, empty_database: str
) -> None:
    """Each lane's messages go to ``a`` and ``b`` in turn, each handed over once the one before
    it was acknowledged, while the lane's first turn runs in ``a``: ``a`` queues its own in
    memory, ``b`` queues its own durably; the turns still run in the order acknowledged."""
    fleet = Fleet(tmp_path, empty_database, lease_secs=30.0, think=(1.0, 1.0))
    fleet.start("a")
    fleet.start("b")
    lanes, rounds = 5, 4
    sent: list[dict[str, object]] = []
    for turn in range(rounds):
        batch = [event(f"o{lane}", f"o{lane} {turn}", f"o{lane}-{turn}") for lane in range(lanes)]
        fleet.deliver("ab"[turn % 2], batch)
        sent += batch
        fleet.wait_for(functools.partial(_acked, fleet, len(sent)), f"round {turn} acknowledged")
    fleet.wait_for(lambda: not fleet.unanswered(sent), "every message answered", 120)
    fleet.stop_all()
    starts = sorted((line for line in fleet.turns() if line["kind"] == "start"),
                    key=lambda line: float(line["t"]))  # fmt: skip
    for lane in range(lanes):
        ran = [line["id"] for line in starts if str(line["key"]).endswith(f"=o{lane}")]
        assert ran == [f"o{lane}-{turn}" for turn in range(rounds)], ran


def test_a_clean_stop_gives_its_leases_up_and_the_others_serve_its_lanes_at_once(
    tmp_path: Path, empty_database: str
) -> None:
    """``a`` runs a turn on each of its lanes while follow-ups for them reach ``b`` (queued
    durably: ``a`` holds the leases); ``a`` then stops cleanly. ``b`` answers the follow-ups
    right after ``a`` exits, not once ``a``'s leases would have expired."""
    lease = 30.0
    fleet = Fleet(tmp_path, empty_database, lease_secs=lease, think=(2.0, 2.0))
    fleet.start("a")
    fleet.start("b")
    first = [event(f"s{n}", f"s{n} first", f"s{n}-0") for n in range(3)]
    fleet.deliver("a", first)
    fleet.wait_for(
        lambda: sum(line["kind"] == "start" for line in fleet.turns()) == len(first),
        "a's turns to start",
    )
    follow = [event(f"s{n}", f"s{n} second", f"s{n}-1") for n in range(3)]
    fleet.deliver("b", follow)
    fleet.wait_for(lambda: len(fleet.acked()) == len(first) + len(follow), "acknowledgements")
    fleet.stop("a")  # drains its turns, then exits
    stopped = float(read_lines(fleet.workdir / "stopped.jsonl")[-1]["t"])
    fleet.wait_for(lambda: not fleet.unanswered(first + follow), "the follow-ups", 90)
    fleet.stop_all()
    assert fleet.answers(first) == {str(item["message_id"]): (1, 0) for item in first}
    for item in follow:
        answered = _answered_at(fleet, str(item["message_id"]))
        assert answered is not None
        assert answered - stopped < lease / 3, f"waited {answered - stopped:.1f} s after a stopped"
    assert _query(empty_database, "SELECT count(*) FROM session_turn_leases") == [(0,)]


def test_a_turn_cut_by_a_kill_resumes_at_once_in_its_restarted_process_after_a_neighbour_restart(
    tmp_path: Path, empty_database: str
) -> None:
    """``b`` restarts cleanly while ``a`` has turns in flight; then ``a`` is SIGKILLed and
    restarted at once. ``b``'s clean start leaves ``a``'s turn markers alone, and ``a``'s new
    boot takes its previous boot's leases back at once and resumes each cut turn, long before
    those leases would expire."""
    lease = 30.0
    fleet = Fleet(tmp_path, empty_database, lease_secs=lease, think=(6.0, 6.0))
    fleet.start("a")
    fleet.start("b")
    mine = [event(f"k{n}", f"k{n} first", f"k{n}-0") for n in range(2)]
    fleet.deliver("a", mine)
    fleet.wait_for(
        lambda: sum(line["kind"] == "start" for line in fleet.turns()) == len(mine),
        "a's turns to start",
    )
    fleet.stop("b")
    fleet.start("b")
    fleet.kill("a")
    fleet.start("a")
    restarted = time.time()
    fleet.wait_for(lambda: not fleet.unanswered(mine), "a's cut turns answered", 90)
    fleet.stop_all()
    resumed = [line for line in fleet.turns() if line["resume"] and line["kind"] == "start"]
    assert sorted(line["for"] for line in resumed) == sorted(str(m["message_id"]) for m in mine)
    assert {line["name"] for line in resumed} == {"a"}
    slowest = max(float(line["t"]) for line in resumed) - restarted
    assert slowest < lease / 3, f"resumed {slowest:.1f} s after a's restart"


def test_a_reset_queued_through_another_process_keeps_what_follows_it_in_order(
    tmp_path: Path, empty_database: str
) -> None:
    """One lane's messages go to ``a`` and ``b``, each once the one before it was
    acknowledged: a message whose turn runs in ``a``, one more and ``/new hello there`` through
    ``b`` (queued durably; ``a`` is woken and takes the reset from the middle of the lane's
    queue), ``/queue later please`` through ``a``, a plain message through ``b``. ``a``'s turn
    ends its step before it stops (a stubborn agent), so all of them are acknowledged while the
    reset waits for it. The reset discards only the message stored before it; its own text
    runs first in the new session; what was sent after the reset is kept, run in acknowledged
    order and answered once."""
    fleet = Fleet(tmp_path, empty_database, lease_secs=30.0, think=(3.0, 3.0), stubborn=True)
    fleet.start("a")
    fleet.start("b")
    busy = event("r", "busy", "r-0")
    fleet.deliver("a", [busy])
    fleet.wait_for(lambda: any(line["kind"] == "start" for line in fleet.turns()), "a's turn")
    after = [
        ("b", event("r", "earlier", "r-1")),
        ("b", event("r", "/new hello there", "r-2")),
        ("a", event("r", "/queue later please", "r-3")),
        ("b", event("r", "plain", "r-4")),
    ]
    for count, (name, item) in enumerate(after, start=2):
        fleet.deliver(name, [item])
        fleet.wait_for(functools.partial(_acked, fleet, count), f"{item['text']} acknowledged")
    started = time.time()
    fleet.wait_for(lambda: len(fleet.sent()) >= 5, "the replies", 90)
    assert started - float(fleet.turns()[0]["t"]) < 3.0  # acknowledged while a's turn ran
    time.sleep(1.0)  # nothing else is sent: a late duplicate would show
    fleet.stop_all()
    acknowledged, *texts = [line["text"] for line in fleet.sent()]
    assert acknowledged.startswith(QUEUED_COMMAND)
    assert texts == [NEW_SESSION, "echo: hello there", "echo: later please", "echo: plain"]
    starts = [line for line in fleet.turns() if line["kind"] == "start"]
    assert [line["id"] for line in starts] == ["r-0", "r-2", "r-3", "r-4"]
    assert len({line["session"] for line in starts[1:]} - {starts[0]["session"]}) == 1
    assert _query(empty_database, "SELECT count(*) FROM queued_events") == [(0,)]
