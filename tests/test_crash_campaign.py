"""A bounded random-kill campaign on SQLite and PostgreSQL: the real ``Gateway`` in a
child process serves six busy lanes and is killed by SIGKILL at random moments, dozens of times;
the platform delivers new messages before every restart and delivers again whatever was not
acknowledged. Then graceful stops timed as turns finish. After a final clean run the promises must
hold: no acknowledged message lost, every message answered, at most one plain and one marked
delivery per reply, no turn resumed twice (or after it was answered).

Kill times follow the durations this machine shows now (start-ups, and the runs that ended before
their kill), so kills land while the gateway works whether the machine is idle or loaded.

The seed is printed; ``CRASH_CAMPAIGN_SEED=<n>`` replays a campaign's choices (not its timing).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path

import pytest
from support.gateway_driver import (
    Tally,
    check_promises,
    configure,
    deliver,
    event,
    read_lines,
    run,
    spawn,
    wait_started,
)

from conftest import CRASH_TABLE
from hermes_core import MessageEvent

pytestmark = pytest.mark.slow

LANES = 6
KILLS = 30
"""Kills a campaign aims at; it restarts until it has them (within ``MAX_RUNS``)."""
KILL_FLOOR = 20
"""Kills every campaign reaches: ``BUDGET_SECS`` can stop it short of ``KILLS``, not of this."""
MAX_RUNS = 3 * KILLS
"""Bound on restarts: a run that ends before its kill is one more clean restart, not a kill."""
GRACEFUL_STOPS = 10
BUDGET_SECS = 45.0
"""Wall-clock bound of one campaign's restarts once ``KILL_FLOOR`` is reached (the final run and
the checks come on top)."""
FIRST_LENGTH = 0.25
"""Seconds a ``serve`` run works after its start, until runs that ended unkilled tell better."""
SEED = int(os.environ.get("CRASH_CAMPAIGN_SEED", "0")) or random.SystemRandom().randrange(1, 10**6)


@pytest.fixture(params=["sqlite", "postgres"])
def platform(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, str]:
    """(workdir, home, backend) with the store of the backend configured."""
    backend = str(request.param)
    url = str(request.getfixturevalue("empty_database")) if backend == "postgres" else None
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    configure(home, url, drain_timeout=0.05)
    return workdir, home, backend


class Traffic:
    """New messages on random lanes, each with a unique text."""

    def __init__(self, rng: random.Random, workdir: Path) -> None:
        self.rng = rng
        self.workdir = workdir
        self.events: list[MessageEvent] = []

    def arrive(self, low: int, high: int) -> None:
        batch: list[MessageEvent] = []
        for _ in range(self.rng.randint(low, high)):
            number = len(self.events) + len(batch) + 1
            chat = str(self.rng.randint(1, LANES))
            batch.append(event(chat, f"lane {chat} message {number}", f"m{number}"))
        deliver(self.workdir, batch)
        self.events.extend(batch)


class KillTimes:
    """When to kill a ``serve`` child, drawn from durations observed in this campaign: every
    start-up, and the work after the start of each run that ended before its kill. A fixed
    window would outlast short runs on a fast machine (their kills never come) and cover only
    their beginning on a slow one."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.startups: list[float] = [0.05]
        self.lengths: list[float] = [FIRST_LENGTH]

    def during_startup(self) -> float:
        """Mostly before ``gateway.start()`` returns (recovery, ledger sweep, resumed turns)."""
        return self.rng.uniform(0, 1.2 * statistics.median(self.startups))

    @property
    def window(self) -> float:
        """Seconds after the start within which kills come: a typical unkilled run's work."""
        return statistics.median(self.lengths)

    def after_start(self) -> float:
        return self.rng.uniform(0, self.window)


def _report(
    label: str, tally: Tally, runs: int, detail: str, capsys: pytest.CaptureFixture[str]
) -> None:
    CRASH_TABLE.append((label, runs, tally.acked, tally.lost, tally.duplicates))
    with capsys.disabled():
        print(f"\n{label} (seed {SEED}): {detail}\n  {tally.summary()}")


def test_random_kill_campaign(
    platform: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    workdir, home, backend = platform
    rng = random.Random(f"{SEED}-kill")
    traffic = Traffic(rng, workdir)
    traffic.arrive(2 * LANES, 2 * LANES)
    times = KillTimes(rng)
    runs = kills = in_startup = 0
    previous_in_startup = False
    stop_by = time.monotonic() + BUDGET_SECS
    while kills < KILLS and runs < MAX_RUNS:
        if kills >= KILL_FLOOR and time.monotonic() > stop_by:
            break
        runs += 1
        traffic.arrive(3, 8)
        before = len(read_lines(workdir / "started.jsonl"))
        spawned = time.monotonic()
        child = spawn(workdir, home, "serve", seed=rng.randrange(2**31))
        # Now and then kill during the start-up, never twice in a row: three interrupted starts
        # in a row would suspend a lane by design.
        if not previous_in_startup and rng.random() < 0.25:
            child.ended_within(times.during_startup())
        elif wait_started(child, workdir, before, time.monotonic() + 30):
            started = time.monotonic()
            times.startups.append(started - spawned)
            if child.ended_within(times.after_start()):
                times.lengths.append(time.monotonic() - started)
        child.kill()
        code = child.wait()
        previous_in_startup = not child.started(workdir, before)
        if code == -signal.SIGKILL:
            kills += 1
            in_startup += previous_in_startup
    assert run(workdir, home, "run") == 0
    tally = check_promises(workdir, home, traffic.events, interruptions=kills)
    detail = (f"{kills} kills ({in_startup} during start-up; window after a start "
              f"{times.window:.3f} s), {runs - kills} runs ended before their kill, "
              f"{len(traffic.events)} messages")  # fmt: skip
    _report(f"campaign [{backend}]", tally, runs + 1, detail, capsys)
    assert kills >= KILL_FLOOR, detail
    assert not tally.problems, f"seed {SEED}: {tally.report()}"


def test_graceful_stops_as_turns_finish(
    platform: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    workdir, home, backend = platform
    rng = random.Random(f"{SEED}-graceful")
    traffic = Traffic(rng, workdir)
    traffic.arrive(LANES, LANES)
    for _ in range(GRACEFUL_STOPS):
        traffic.arrive(3, 8)
        child = spawn(workdir, home, "graceful", seed=rng.randrange(2**31))
        assert child.wait() == 0, child.output()
    assert run(workdir, home, "run") == 0
    tally = check_promises(workdir, home, traffic.events, interruptions=GRACEFUL_STOPS)
    detail = f"{GRACEFUL_STOPS} graceful stops, {len(traffic.events)} messages"
    _report(f"graceful stops [{backend}]", tally, GRACEFUL_STOPS + 1, detail, capsys)
    assert not tally.problems, f"seed {SEED}: {tally.report()}"
