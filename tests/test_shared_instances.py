"""Several gateway processes on one PostgreSQL database (``storage.instances: shared``)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.gateway_driver import read_lines
from support.shared_driver import SPAWN, Fleet, configure, event, replies, shared_child

pytestmark = [pytest.mark.postgres, pytest.mark.multi_process, pytest.mark.slow]


def _overlaps(workdir: Path) -> int:
    """Pairs of turns of one lane that ran at the same time (by the harness's spans)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for path in workdir.glob("spans-*.jsonl"):
        for line in read_lines(path):
            spans.setdefault(line["key"], []).append((line["start"], line["end"]))
    starts: dict[tuple[str, str], float] = {}
    for path in workdir.glob("turns-*.jsonl"):
        for line in read_lines(path):
            if line["kind"] == "start":
                starts[path.name, line["key"]] = line["t"]
            elif (path.name, line["key"]) in starts:
                start = starts.pop((path.name, line["key"]))
                spans.setdefault(line["key"], []).append((start, line["t"]))
    overlaps = 0
    for runs in spans.values():
        runs.sort()
        overlaps += sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
    return overlaps


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_fed_the_same_lanes_never_overlap_a_lane(
    tmp_path: Path, empty_database: str, processes: int
) -> None:
    lanes, rounds = 6, 3
    feeds: dict[int, list[dict[str, object]]] = {n: [] for n in range(processes)}
    count = 0
    for turn in range(rounds):
        for lane in range(lanes):
            for n in range(processes):  # every lane gets a message through every process
                feeds[n].append(event(f"c{lane}", f"m{turn}-{n}", f"{lane}-{turn}-{n}"))
                count += 1
    workdir = tmp_path / "work"
    workdir.mkdir()
    children = []
    for n in range(processes):
        home = tmp_path / f"home{n}"
        configure(home, empty_database)
        child = SPAWN.Process(
            target=shared_child, args=(str(home), str(workdir), f"p{n}", feeds[n], count)
        )
        child.start()
        children.append(child)
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    assert len(read_lines(workdir / "started.jsonl")) == processes  # all came up together
    sent = replies(workdir)
    answered = {line["reply_to"] for line in sent}
    assert answered == {f"{lane}-{turn}-{n}" for lane in range(lanes) for turn in range(rounds)
                        for n in range(processes)}  # fmt: skip
    assert len(sent) == count  # each reply once
    assert _overlaps(workdir) == 0
    engine = create_engine(empty_database)
    with engine.connect() as conn:
        open_per_key = conn.execute(text(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM sessions WHERE end_reason IS NULL "
            "GROUP BY session_key) AS c"
        )).scalar()  # fmt: skip
        leases_left = conn.execute(text("SELECT count(*) FROM session_turn_leases")).scalar()
    engine.dispose()
    assert open_per_key == 1
    assert leases_left == 0  # every lane handed back when it ran dry


def _lane_events(prefix: str, lanes: int, rounds: int) -> list[dict[str, object]]:
    return [event(f"{prefix}{lane}", f"{prefix}{lane} turn {turn}", f"{prefix}{lane}-{turn}")
            for turn in range(rounds) for lane in range(lanes)]  # fmt: skip


def _query(url: str, sql: str, **params: object) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [tuple(row) for row in conn.execute(text(sql), params)]
    engine.dispose()
    return rows


@pytest.mark.parametrize("how", ["clean", "sigkill"])
def test_a_restart_of_one_process_leaves_the_other_processes_work_alone(
    tmp_path: Path, empty_database: str, how: str
) -> None:
    fleet = Fleet(tmp_path, empty_database, think=(1.0, 1.0))
    fleet.start("a")
    fleet.start("b")
    mine, theirs = _lane_events("a", 4, 3), _lane_events("b", 4, 2)
    fleet.deliver("a", mine)
    fleet.deliver("b", theirs)
    fleet.wait_for(lambda: len(fleet.acked()) == len(mine) + len(theirs), "acknowledgements")
    started = [line for line in fleet.turns() if line["kind"] == "start"]
    assert {line["name"] for line in started} == {"a", "b"}  # both have turns in flight
    ours = tuple(f"=a{n}" for n in range(4))
    waiting = _query(empty_database, "SELECT session_key FROM queued_events WHERE dead_at IS NULL")
    assert any(str(row[0]).endswith(ours) for row in waiting)  # a's rows wait behind its turns
    if how == "clean":
        fleet.stop("b")
    else:
        fleet.kill("b")
    # b's turns cut short: started and not ended when it stopped (under load some of b's
    # acknowledged messages may still wait in its queue rather than run). Only b's own turns
    # count: after a clean stop, which gives b's leases up, a runs what waits on b's lanes at
    # once, so a turn of a on one of them may have started and not yet ended here.
    own = [line for line in fleet.turns() if line["name"] == "b"]
    ends = Counter(line["key"] for line in own if line["kind"] == "end")
    starts = Counter(line["key"] for line in own if line["kind"] == "start")
    cut = sorted(key for key in starts if starts[key] > ends[key])
    fleet.start("b")  # recovery, ledger sweep and resume of the new boot of b
    fleet.wait_for(lambda: not fleet.unanswered(mine + theirs), "every message answered")
    fleet.stop_all()
    answers = fleet.answers(mine + theirs)
    assert all(answers[str(item["message_id"])] == (1, 0) for item in mine)  # once, plainly
    to_a = [line for line in fleet.sent() if str(line["chat"]).startswith("a")]
    assert {line["name"] for line in to_a} == {"a"}  # nothing of a's re-sent by b
    runs = [line for line in fleet.turns() if str(line["key"]).endswith(ours)]
    assert {line["name"] for line in runs} == {"a"}  # a's queue was never restored by b
    assert not any(line["resume"] for line in runs)
    assert Counter(line["id"] for line in runs if line["kind"] == "start") == Counter(
        str(item["message_id"]) for item in mine
    )  # each of a's items run once, its in-flight turns finished where they ran
    assert all(plain <= 1 and marked <= 1 for plain, marked in answers.values())
    resumed = [line for line in fleet.turns() if line["resume"] and line["kind"] == "start"]
    if how == "sigkill":
        assert cut  # the kill cut turns short
        assert sorted(line["key"] for line in resumed) == cut  # each resumed once
    else:
        assert not cut  # a clean stop drains its turns
        assert not resumed
        assert all(answers[str(item["message_id"])] == (1, 0) for item in theirs)
    assert _overlaps(fleet.workdir) == 0


def _more(fleet: Fleet, before: int) -> bool:
    return len(fleet.sent()) > before


def test_new_through_one_process_holds_on_the_next_message_through_another(
    tmp_path: Path, empty_database: str
) -> None:
    fleet = Fleet(tmp_path, empty_database, think=(0.05, 0.05))
    fleet.start("a")
    fleet.start("b")
    steps = [("a", "hello", "m1"), ("b", "/new", "m2"), ("a", "after", "m3"), ("b", "more", "m4")]
    for name, words, message_id in steps:
        before = len(fleet.sent())
        fleet.deliver(name, [event("c0", words, message_id)])
        fleet.wait_for(functools.partial(_more, fleet, before), f"the answer to {words}")
    assert "New session" in fleet.sent()[1]["text"]
    fleet.stop_all()
    sessions = {line["id"]: line["session"] for line in fleet.turns() if line["kind"] == "start"}
    assert sessions["m1"] != sessions["m3"] == sessions["m4"]
    open_sessions = _query(empty_database, "SELECT count(*) FROM sessions WHERE end_reason IS NULL")
    assert open_sessions[0][0] == 1
