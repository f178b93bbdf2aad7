"""A bounded random-kill campaign on SQLite and PostgreSQL: the real ``Gateway`` in a
child process serves six busy lanes and is killed by SIGKILL at random moments, dozens of times;
the platform delivers new messages before every restart and delivers again whatever was not
acknowledged. Then graceful stops timed as turns finish. After a final clean run the promises must
hold: no acknowledged message lost, every message answered, at most one plain and one marked
delivery per reply, no turn resumed twice (or after it was answered).

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
GRACEFUL_STOPS = 10
BUDGET_SECS = 45.0
"""Wall-clock bound of one campaign's restarts (the final run and the checks come on top)."""
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
    kills = in_startup = finished = 0
    startups: list[float] = [0.05]
    previous_in_startup = False
    stop_by = time.monotonic() + BUDGET_SECS
    for _ in range(KILLS):
        if time.monotonic() > stop_by:
            break
        traffic.arrive(3, 8)
        before = len(read_lines(workdir / "started.jsonl"))
        spawned = time.monotonic()
        child = spawn(workdir, home, "serve", seed=rng.randrange(2**31))
        # Now and then kill during the start-up (recovery, ledger sweep, resumed turns), never
        # twice in a row: three interrupted starts in a row would suspend a lane by design.
        if not previous_in_startup and rng.random() < 0.25:
            time.sleep(rng.uniform(0, 1.2 * statistics.median(startups)))
        elif wait_started(child, workdir, before, time.monotonic() + 30):
            startups.append(time.monotonic() - spawned)
            time.sleep(rng.uniform(0, 0.25))
        child.kill()
        code = child.wait()
        previous_in_startup = not child.started(workdir, before)
        if code == -signal.SIGKILL:
            kills += 1
            in_startup += previous_in_startup
        else:
            finished += 1
    assert run(workdir, home, "run") == 0
    tally = check_promises(workdir, home, traffic.events, interruptions=kills)
    detail = (f"{kills} kills ({in_startup} during start-up), {finished} runs ended before "
              f"their kill, {len(traffic.events)} messages")  # fmt: skip
    _report(f"campaign [{backend}]", tally, kills + finished + 1, detail, capsys)
    assert kills >= 20, detail
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
