"""The acknowledgement point: ``Gateway.handle_message`` returns only once the event
is durably stored, the turn's first commit for an idle lane, the queue's commit for a busy one.
The real ``Gateway`` runs in a child process (``support/gateway_driver.py``) that SIGKILLs itself
right after ``handle_message`` returned for the last event, after the acknowledgement was written
(the platform considers the message delivered: the store alone must get it answered) or before
(the platform delivers it again: the redelivery must be ignored). After two clean restarts the
message is stored once, answered once with no restart-marked copy, and no lane is left unfinished.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.gateway_driver import (
    acked_ids,
    answer_counts,
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

pytestmark = pytest.mark.slow

KILLED = -signal.SIGKILL


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


def _events(lane: str) -> list[MessageEvent]:
    """The target is the last event; on a busy lane an earlier turn of its chat still runs."""
    if lane == "idle":
        return [event("1", "is anyone there", "m1")]
    return [event("1", "first question", "m1"), event("1", "second question", "m2")]


def _check_kill_point(
    workdir: Path, home: Path, events: list[MessageEvent], lane: str, variant: str
) -> None:
    """What the kill left: the target stored (turn begun or queued), nothing sent yet, and the
    acknowledgement written or not."""
    target = events[-1]
    assert (target.event_id in acked_ids(workdir)) == (variant == "after-ack")
    assert read_lines(workdir / "outbox.jsonl") == [], "a reply was sent before the kill"
    with open_store(home) as store:
        key = store.session_key_for(target.source)
        entry = store.lookup_by_session_key(key)
        assert entry is not None, f"{key} has no session after the kill"
        assert entry.active_turn_token is not None, "no turn was running at the kill"
        stored = [
            str(m.get("platform_message_id"))
            for m in store.load_transcript(entry.session_id)
            if m.get("role") == "user"
        ]
        queued = [(k, str(e.message_id)) for _, k, e in store._queue.restore()]
    if lane == "idle":
        assert stored == [target.message_id]
        assert queued == []
    else:
        assert stored == [events[0].message_id]
        assert queued == [(key, target.message_id)]


@pytest.mark.parametrize("variant", ["after-ack", "before-ack"])
@pytest.mark.parametrize("lane", ["idle", "busy"])
def test_kill_right_after_handle_message(
    lane: str, variant: str, backend: str, platform: tuple[Path, Path]
) -> None:
    workdir, home = platform
    events = _events(lane)
    target = events[-1]
    deliver(workdir, events)
    child = spawn(workdir, home, f"ackkill-{variant.removesuffix('-ack')}")
    code = child.wait()
    assert code == KILLED, f"the ack-kill point was never reached (exit {code}):\n{child.output()}"
    _check_kill_point(workdir, home, events, lane, variant)

    for _ in range(2):  # the first restart gets the redelivery when the ack was not written
        assert run(workdir, home, "run") == 0
    tally = check_promises(workdir, home, events, interruptions=1)
    label = f"ack-kill {lane} {variant} [{backend}]"
    CRASH_TABLE.append((label, 2, tally.acked, tally.lost, tally.duplicates))
    assert not tally.problems, tally.report()

    with open_store(home) as store:
        entry = store.lookup_by_session_key(store.session_key_for(target.source))
        assert entry is not None
        assert not entry.resume_pending
        assert entry.active_turn_token is None
        transcript = store.load_transcript(entry.session_id)
    for item in events:
        copies = [
            m
            for m in transcript
            if m.get("role") == "user" and str(m.get("platform_message_id")) == item.message_id
        ]
        assert [m.get("content") for m in copies] == [item.text], transcript
        assert answer_counts(workdir, item) == (1, 0), read_lines(workdir / "outbox.jsonl")
