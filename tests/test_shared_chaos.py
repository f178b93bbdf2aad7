"""The chaos test of several gateway processes on one PostgreSQL database (issue 14).

Four processes serve 200 lanes, several turns each, every message handed to a random process;
meanwhile processes are SIGKILLed at random and restarted (what they had not acknowledged the
platform hands over again). The harness records acknowledgements, turn spans and deliveries in
files; the promises are checked on those: no acknowledged message lost, no queued item run
twice, each reply delivered at most once plainly and once marked as a possible duplicate, and
every turn a kill cut short resumed exactly once, before anything else runs on its lane, within
the lease plus the scan interval (and some slack) of the last kill before the resume. The counts
are printed. ``HERMES_TEST_CHAOS_SEED`` picks another random schedule.
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from support.shared_driver import Fleet, event

pytestmark = [pytest.mark.postgres, pytest.mark.multi_process, pytest.mark.slow]


PROCESSES = 4
LANES = 200
TURNS = 3
KILLS = 6
LEASE_SECS = 3.0
SCAN_SECS = 0.5
THINK = (0.05, 0.4)
"""Seconds a turn's agent thinks: long enough that kills find turns in flight."""
FIRST_KILL = (0.3, 0.8)
"""Seconds from the first hand-over to the first kill (random), while the waves' turns run (each
lane's three think 0.7 s on average, one after another)."""
KILL_GAP = (0.8, 2.0)
"""Seconds between later kills (random). A kill that is due waits, while messages are still
unanswered, until some process has a turn running: the victim is one of those, so the kills cut
turns short however fast the machine runs the waves."""
RESTART_AFTER = (0.2, 1.0)
"""Seconds a killed process stays dead before it is restarted."""
RESUME_SLACK = 12.0
"""Seconds beyond lease plus scan interval a takeover may take to start the resumed turn: the
recovery of every lane the dead process held, on a loaded two-core machine (up to 9 s were seen
with two copies of this test running at once)."""
DEADLINE = 150.0
SEED = int(os.environ.get("HERMES_TEST_CHAOS_SEED", "14"))


@dataclass
class Kill:
    """A SIGKILL: the process's name, its pid and the wall-clock time just before it."""

    name: str
    pid: int
    t: float


@dataclass
class Chaos:
    """The platform's side of the run: messages handed over in waves (one per turn of every
    lane, each message to a random process; the next wave once the last is acknowledged), kills
    at random gaps, each followed by a restart."""

    fleet: Fleet
    rng: random.Random
    waves: list[list[dict[str, Any]]]
    kills: list[Kill] = field(default_factory=list)
    restarts: dict[str, float] = field(default_factory=dict)
    """Killed processes and when they are restarted."""
    launched: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    handed: int = 0

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [item for wave in self.waves for item in wave]

    def launch(self, name: str) -> None:
        """Start (or restart) the process without waiting for its gateway to start."""
        self.fleet.start(name, wait=False)
        self.launched[name] += 1

    def run(self) -> None:
        """Hand over every wave and make every kill, then wait until every message is answered
        and every process is up; fails with what was missing at the deadline."""
        fleet = self.fleet
        names = [f"p{n}" for n in range(PROCESSES)]
        started = time.monotonic()
        next_kill = started + self.rng.uniform(*FIRST_KILL)
        while True:
            now = time.monotonic()
            acked = fleet.acked()
            if self.handed < len(self.waves) and (
                self.handed == 0 or _ids(self.waves[self.handed - 1]) <= acked
            ):
                self.hand_over(self.waves[self.handed], names)
                self.handed += 1
            for name, due in list(self.restarts.items()):
                if now >= due:
                    del self.restarts[name]
                    self.launch(name)
            due = len(self.kills) < KILLS and now >= next_kill
            if due and self.kill([name for name in names if self.up(name)]):
                next_kill = now + self.rng.uniform(*KILL_GAP)
            if (
                self.handed == len(self.waves) and len(self.kills) == KILLS
                and not self.restarts and all(self.up(name) for name in names)
                and not fleet.unanswered(self.messages)
            ):  # fmt: skip
                return
            if now - started > DEADLINE:
                raise AssertionError(self.missing(names))
            time.sleep(0.1)

    def hand_over(self, wave: list[dict[str, Any]], names: list[str]) -> None:
        feeds: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for item in wave:
            feeds[self.rng.choice(names)].append(item)
        for name, items in feeds.items():
            self.fleet.deliver(name, items)

    def up(self, name: str) -> bool:
        """The process runs and its gateway has started since its last (re)start (only such
        processes are killed, so every launch but a running one has started)."""
        fleet = self.fleet
        return fleet.alive(name) and fleet.started(name) == self.launched[name]

    def kill(self, candidates: list[str]) -> bool:
        """SIGKILL one of ``candidates`` with a turn running now or, once every message is
        answered, any of them; False when there is none to kill yet."""
        fleet = self.fleet
        current = {fleet.children[name].pid: name for name in candidates}
        running = sorted(
            {current[t.pid] for t in _turns(fleet) if t.end is None and t.pid in current}
        )
        if not running and fleet.unanswered(self.messages):
            return False
        pool = running or candidates
        if not pool:
            return False
        name = self.rng.choice(pool)
        process = self.fleet.children[name]
        assert process.pid is not None
        self.kills.append(Kill(name, process.pid, time.time()))
        self.fleet.kill(name)
        self.restarts[name] = time.monotonic() + self.rng.uniform(*RESTART_AFTER)
        return True

    def missing(self, names: list[str]) -> str:
        """What the run was still waiting for."""
        fleet = self.fleet
        everything = self.messages
        unanswered = fleet.unanswered(everything)
        down = [name for name in names if not self.up(name)]
        return (
            f"timed out after {DEADLINE} s waiting for every message answered: "
            f"{self.handed}/{len(self.waves)} waves handed over, {len(self.kills)}/{KILLS} kills, "
            f"{len(fleet.acked())}/{len(everything)} acknowledged, {len(unanswered)} unanswered "
            f"(first: {unanswered[:10]}), processes not up: {down}\n{fleet.logs()}"
        )


def _ids(items: list[dict[str, Any]]) -> set[str]:
    return {str(item["message_id"]) for item in items}


@dataclass
class Turn:
    """One turn an agent started (from the harness's turn logs)."""

    name: str
    pid: int
    key: str
    answers: str | None
    resume: bool
    start: float
    end: float | None = None
    reply: str | None = None


def _turns(fleet: Fleet) -> list[Turn]:
    """Every turn started, with its end and reply where it got that far, by start time."""
    turns: list[Turn] = []
    running: dict[tuple[int, str], Turn] = {}
    for line in sorted(fleet.turns(), key=lambda line: float(line["t"])):
        where = (int(line["pid"]), str(line["key"]))
        if line["kind"] == "start":
            turn = Turn(str(line["name"]), int(line["pid"]), str(line["key"]), line["for"],
                        bool(line["resume"]), float(line["t"]))  # fmt: skip
            running[where] = turn
            turns.append(turn)
        else:
            turn = running.pop(where)
            turn.end, turn.reply = float(line["t"]), line["reply"]
    return turns


@dataclass
class Counts:
    """What the chaos test counts (printed)."""

    messages: int = 0
    acked: int = 0
    lost: int = 0
    run_twice: int = 0
    plain_twice: int = 0
    marked_twice: int = 0
    marked: int = 0
    kills: int = 0
    crashed_turns: int = 0
    resumed: int = 0
    overtaken: int = 0
    """Resumes another turn of the lane ran before."""
    resent_marked: int = 0
    not_resumed: int = 0
    resumed_twice: int = 0
    reordered: int = 0
    """Lanes whose messages first ran in another order than acknowledged."""
    slowest_resume: float = 0.0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"messages={self.messages} acked={self.acked} lost={self.lost} "
            f"run_twice={self.run_twice} plain_twice={self.plain_twice} "
            f"marked_twice={self.marked_twice} marked={self.marked} kills={self.kills} "
            f"crashed_turns={self.crashed_turns} resumed={self.resumed} "
            f"overtaken={self.overtaken} resent_marked={self.resent_marked} "
            f"not_resumed={self.not_resumed} resumed_twice={self.resumed_twice} "
            f"reordered={self.reordered} slowest_resume={self.slowest_resume:.2f}s"
        )


def _count(chaos: Chaos) -> Counts:
    fleet = chaos.fleet
    everything = chaos.messages
    counts = Counts(messages=len(everything), kills=len(chaos.kills))
    acked = fleet.acked()
    counts.acked = len(acked & _ids(everything))
    answers = fleet.answers(everything)
    for ident, (plain, marked) in answers.items():
        counts.marked += marked
        if ident in acked and plain + marked == 0:
            counts.lost += 1
            counts.problems.append(f"acknowledged {ident} was never answered")
        if plain > 1:
            counts.plain_twice += 1
            counts.problems.append(f"{ident} was delivered plainly {plain} times")
        if marked > 1:
            counts.marked_twice += 1
            counts.problems.append(f"{ident} was re-sent marked {marked} times")
    turns = _turns(fleet)
    runs: dict[str, int] = defaultdict(int)
    for turn in turns:
        if not turn.resume:
            runs[str(turn.answers)] += 1
    for ident, times in runs.items():
        if times > 1:
            counts.run_twice += 1
            counts.problems.append(f"queued item {ident} ran {times} times")
    _check_order(turns, counts)
    _check_resumes(chaos, turns, counts)
    return counts


def _check_order(turns: list[Turn], counts: Counts) -> None:
    """A lane's messages were acknowledged in wave order (a wave is handed over once the last
    one is acknowledged), whichever process took each: their turns first start in that order
    (SPEC §8.4)."""
    firsts: dict[str, list[int]] = defaultdict(list)
    for turn in turns:  # by start time
        if turn.resume or turn.answers is None:
            continue
        wave = int(str(turn.answers).rsplit("-", 1)[1])
        if wave not in firsts[turn.key]:
            firsts[turn.key].append(wave)
    for key, waves in firsts.items():
        if waves != sorted(waves):
            counts.reordered += 1
            counts.problems.append(f"{key}: messages ran in wave order {waves}")


def _check_resumes(chaos: Chaos, turns: list[Turn], counts: Counts) -> None:
    """Every turn a kill cut short (its process died before sending its reply) is followed by
    one resume of its message, before anything else runs on its lane and within lease + scan
    interval (+ slack) of the last kill, unless its reply was stored and is re-sent marked; no
    message is resumed after it was answered."""
    fleet = chaos.fleet
    killed = {kill.pid: kill for kill in chaos.kills}
    sent: dict[int, set[tuple[str, str]]] = defaultdict(set)
    answered_at: dict[tuple[str, str], float] = {}
    for line in fleet.sent():
        sent[int(line["pid"])].add((str(line["chat"]), str(line["text"])))
        answered_at.setdefault((str(line["chat"]), str(line["text"])), float(line["t"]))
    marked = {ident for ident, (_, times) in fleet.answers(chaos.messages).items() if times}
    chats = {str(item["message_id"]): str(item["source"]["chat_id"]) for item in chaos.messages}
    texts = {str(item["message_id"]): f"echo: {item['text']}" for item in chaos.messages}
    by_message: dict[str, list[Turn]] = defaultdict(list)
    by_lane: dict[str, list[Turn]] = defaultdict(list)
    for turn in turns:
        by_message[str(turn.answers)].append(turn)
        by_lane[turn.key].append(turn)
    bound = LEASE_SECS + SCAN_SECS + RESUME_SLACK
    for ident, chain in by_message.items():
        reply = (chats.get(ident, ""), texts.get(ident, ""))
        first_answer = answered_at.get(reply)
        for turn in chain:
            if turn.resume and first_answer is not None and turn.start > first_answer:
                counts.resumed_twice += 1
                counts.problems.append(f"{ident} was resumed after it was answered")
        for number, turn in enumerate(chain):
            kill = killed.get(turn.pid)
            if kill is None or (turn.reply is not None and reply in sent[turn.pid]):
                continue  # not cut short by a kill: answered by its own process
            counts.crashed_turns += 1
            later = chain[number + 1 :]
            lane = by_lane[turn.key]
            following = lane[lane.index(turn) + 1 :]
            if later and later[0].resume and following[0] is not later[0]:
                counts.overtaken += 1
                counts.problems.append(f"{ident}: the lane ran {following[0]} before the resume")
            if later and later[0].resume:
                counts.resumed += 1
                # A later kill may hit the process taking the lane over: the clock restarts.
                last = max((k.t for k in chaos.kills if k.t < later[0].start), default=kill.t)
                latency = later[0].start - last
                counts.slowest_resume = max(counts.slowest_resume, latency)
                if latency > bound:
                    counts.problems.append(
                        f"{ident}: resumed {latency:.1f} s after the last kill before it "
                        f"(bound {bound:.1f} s; {kill.name} running it was killed "
                        f"{later[0].start - kill.t:.1f} s before)"
                    )
            elif not later and ident in marked and turn.end is not None:
                counts.resent_marked += 1  # its reply was stored before the kill
            else:
                counts.not_resumed += 1
                counts.problems.append(
                    f"{ident}: the turn {kill.name} (pid {kill.pid}) was running when killed "
                    f"was not resumed (next: {later[:1]})"
                )


def _leftovers(url: str) -> dict[str, int]:
    """What the store still holds after the clean stop of every process (lease rows are
    counted for the printout only)."""
    queries = {
        "markers": "SELECT count(*) FROM gateway_routing WHERE active_turn_token IS NOT NULL",
        "resume_pending": "SELECT count(*) FROM gateway_routing WHERE resume_pending <> 0",
        "queued": "SELECT count(*) FROM queued_events WHERE dead_at IS NULL",
        "owed": "SELECT count(*) FROM delivery_obligations WHERE state IN "
        "('pending', 'attempting')",
        "leases": "SELECT count(*) FROM session_turn_leases",
    }
    engine = create_engine(url)
    with engine.connect() as conn:
        left = {name: int(conn.execute(text(sql)).scalar() or 0) for name, sql in queries.items()}
    engine.dispose()
    return left


def test_random_kills_lose_nothing_and_resume_each_cut_turn_once(
    tmp_path: Path, empty_database: str
) -> None:
    began = time.monotonic()
    rng = random.Random(SEED)
    fleet = Fleet(tmp_path, empty_database, lease_secs=LEASE_SECS, scan_secs=SCAN_SECS,
                  think=THINK)  # fmt: skip
    waves = [
        [event(f"c{lane}", f"c{lane} turn {turn}", f"c{lane}-{turn}") for lane in range(LANES)]
        for turn in range(TURNS)
    ]
    chaos = Chaos(fleet, rng, waves)
    for n in range(PROCESSES):
        chaos.launch(f"p{n}")
    fleet.wait_for(lambda: all(chaos.up(f"p{n}") for n in range(PROCESSES)), "the start", 60)
    try:
        chaos.run()
    finally:
        fleet.stop_all()
    counts = _count(chaos)
    left = _leftovers(empty_database)
    print(f"\nchaos (seed {SEED}, {time.monotonic() - began:.1f} s): {counts.line()} left={left}")
    assert counts.problems == [], "\n".join(counts.problems[:30])
    assert counts.acked == counts.messages
    assert counts.kills == KILLS
    assert counts.crashed_turns > 0  # the kills did cut turns short
    assert counts.crashed_turns == counts.resumed + counts.resent_marked
    # A lease row may outlive a killed boot that held an idle lane (nothing waited there, so no
    # takeover claimed it); it blocks nothing: the lane's next message takes the expired lease.
    work = {name: count for name, count in left.items() if name != "leases"}
    assert work == dict.fromkeys(work, 0)
