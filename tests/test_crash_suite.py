"""The crash suite: the real ``Gateway`` runs in a child process behind a platform
simulated in files (``support/gateway_driver.py``) and is killed by SIGKILL at every crash point,
on SQLite and on PostgreSQL; restarted twice, the recovery promises must hold: no acknowledged
message lost, every message answered, each reply delivered at most once plainly plus at most once
with the restart prefix, no turn resumed twice, no lane left ``resume_pending`` or marked active.
The same points are also reached while a start-up recovers from an earlier crash. A table of the
runs is printed at the end.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.gateway_driver import (
    check_promises,
    configure,
    deliver,
    event,
    open_store,
    read_lines,
    run,
    spawn,
)

from conftest import CRASH_TABLE
from hermes_core import MessageEvent
from hermes_core.turns.crashpoints import CONNECTOR_CRASH_POINTS, CRASH_ALIASES, CRASH_POINTS, arm
from hermes_core.turns.resume import resume_note

pytestmark = pytest.mark.slow

KILLED = -signal.SIGKILL
STUCK_KEY = "agent:main:telegram:dm:c=1"


def _events() -> list[MessageEvent]:
    """Three lanes; chat 1's second message arrives while its first turn is running."""
    return [event("1", "first question", "m1"), event("2", "hello there", "m2"),
            event("1", "second question", "m3"), event("3", "good morning", "m4")]  # fmt: skip


def _mode(point: str) -> str:
    """The drain points are passed only by a stop whose drain times out."""
    return "drain" if point.startswith("drain_") else "run"


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def platform(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(workdir, home) with the store of ``backend`` configured and an empty platform."""
    url = str(request.getfixturevalue("empty_database")) if backend == "postgres" else None
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    configure(home, url)
    return workdir, home


def _crash(workdir: Path, home: Path, mode: str, point: str) -> bool:
    """Run until SIGKILL at ``point``; True when it died before ``gateway.start()`` returned."""
    started = len(read_lines(workdir / "started.jsonl"))
    child = spawn(workdir, home, mode, point)
    code = child.wait()
    assert code == KILLED, f"{point} was never reached ({mode}, exit {code}):\n{child.output()}"
    return len(read_lines(workdir / "started.jsonl")) == started


def _finish_and_check(
    workdir: Path, home: Path, events: list[MessageEvent], label: str, backend: str, kills: int
) -> None:
    """Two clean restarts, then every promise; the run goes into the summary table first."""
    for _ in range(2):  # a gateway restarted twice in a row never resumes a turn twice
        assert run(workdir, home, "run") == 0
    tally = check_promises(workdir, home, events, interruptions=kills)
    CRASH_TABLE.append((f"{label} [{backend}]", 2, tally.acked, tally.lost, tally.duplicates))
    assert not tally.problems, tally.report()


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_point(point: str, backend: str, platform: tuple[Path, Path]) -> None:
    workdir, home = platform
    events = _events()
    deliver(workdir, events)
    _crash(workdir, home, _mode(point), point)
    _finish_and_check(workdir, home, events, point, backend, kills=1)


# A first crash that leaves work for the next start-up, then a crash while that start-up does it:
# - marker_written: the next start resumes the turn (its user message stored, nothing answered);
#   the resumed turn then dies once its reply is recorded (reply_stored), once the platform has
#   it but the ledger does not know (sent), and once the ledger settled it and closed the turn
#   but nothing after it ran (marker_cleared: the interrupted message was stored but never
#   acknowledged, so the platform delivers it again to a start that no longer resumes anything).
# - reply_stored: the next start records the crash-left reply and re-sends it with the restart
#   prefix; that re-send dies after the platform got it (sent) or after the ledger settled it
#   and cleared the lane's resume flag (marker_cleared).
# - sent: the ledger row is left ``attempting``, the next start re-sends it marked and dies right
#   after the platform got the re-send: a third start must not send it a third time.
# - drain_timed_out: a turn cut short by a drain resumes after the restart and dies once its
#   reply was delivered and the turn closed.
RECOVERY_PAIRS = [
    ("marker_written", "reply_stored"),
    ("marker_written", "sent"),
    ("marker_written", "marker_cleared"),
    ("reply_stored", "sent"),
    ("reply_stored", "marker_cleared"),
    ("sent", "sent"),
    ("drain_timed_out", "marker_cleared"),
]


@pytest.mark.parametrize(("first", "second"), RECOVERY_PAIRS,
                         ids=[f"{a}-then-{b}" for a, b in RECOVERY_PAIRS])  # fmt: skip
def test_crash_during_recovery(
    first: str, second: str, backend: str, platform: tuple[Path, Path]
) -> None:
    workdir, home = platform
    events = _events()
    deliver(workdir, events)
    _crash(workdir, home, _mode(first), first)
    during_start = _crash(workdir, home, "run", second)
    assert during_start, f"{second} was reached only after the start-up recovering {first}"
    _finish_and_check(workdir, home, events, f"{first} > {second}", backend, kills=2)


@pytest.mark.parametrize("name", [*CRASH_POINTS, *CRASH_ALIASES])
def test_every_name_arms_its_place(name: str) -> None:
    """One point per place: a name the specification gives a place twice arms that place."""
    try:
        point = CRASH_ALIASES.get(name, name)
        assert point in CRASH_POINTS
        assert arm({"HERMES_CRASH_AT": name}) == point
        assert arm({"HERMES_CRASH_AT": f"{name}_typo"}) is None
    finally:
        arm({})


@pytest.mark.parametrize("name", CONNECTOR_CRASH_POINTS)
def test_connector_points_arm(name: str) -> None:
    """The connectors' points are armed like the gateway's (their tests run a serving process)."""
    try:
        assert arm({"HERMES_CRASH_AT": name}) == name
    finally:
        arm({})


def test_resume_note_names_the_interruption() -> None:
    assert "by a gateway shutdown before" in resume_note("shutdown_timeout", synthesized=True)
    assert "by a gateway interruption before" in resume_note(
        "restart_interrupted", synthesized=False
    )


def _counts(home: Path) -> dict[str, int]:
    with open_store(home) as store:
        return store._counts.open().load()


def test_stuck_loop_suspends_after_three_interrupted_restarts(
    platform: tuple[Path, Path],
) -> None:
    workdir, home = platform
    deliver(workdir, _events()[:1])
    # The turn and each automatic resume of it die at the same point; the later starts get no
    # platform traffic, so only the resumes reach it.
    _crash(workdir, home, "run", "marker_written")
    for expected in (1, 2):
        assert _crash(workdir, home, "recover", "marker_written")
        assert _counts(home) == {STUCK_KEY: expected}
    assert run(workdir, home, "recover", "marker_written") == 0  # third strike: no resume
    assert _counts(home) == {}
    with open_store(home) as store:
        stuck = store.lookup_by_session_key(STUCK_KEY)
        assert stuck is not None
        assert stuck.suspended
        fresh = store.get_or_create_session(_events()[0].source)
        assert fresh.session_id != stuck.session_id
        assert (fresh.was_auto_reset, fresh.auto_reset_reason) == (True, "suspended")


def test_a_successful_turn_resets_the_strike_count(platform: tuple[Path, Path]) -> None:
    workdir, home = platform
    deliver(workdir, _events()[:1])
    _crash(workdir, home, "run", "marker_written")
    assert _crash(workdir, home, "recover", "marker_cleared")  # resumed, succeeded, then killed
    assert _counts(home) == {}
    assert run(workdir, home, "run") == 0
    assert _counts(home) == {}
