"""Routing entries on a shared PostgreSQL store: a process never overwrites another's newer
entry from its own cached copy (optimistic concurrency on the row's ``revision``). Each store
below stands for a gateway process of its own."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from support.database import run_sql

from hermes_core import SessionEntry, SessionSource
from hermes_core.domain.errors import RoutingConflictError
from hermes_core.store import SessionStore

pytestmark = pytest.mark.postgres

SOURCE = SessionSource(platform="telegram", chat_id="c1", chat_type="dm", user_id="c1")


def _stored(url: str, key: str) -> tuple[dict[str, Any], list[tuple[str, str | None]]]:
    """The key's routing entry as stored, and its sessions (id, end reason), oldest first."""
    [(entry,)] = run_sql(url, "SELECT entry_json FROM gateway_routing WHERE session_key = :key",
                         key=key)  # fmt: skip
    sessions = run_sql(
        url, "SELECT id, end_reason FROM sessions WHERE session_key = :key ORDER BY started_at",
        key=key,
    )  # fmt: skip
    return json.loads(entry), [(row[0], row[1]) for row in sessions]


WRITES: dict[str, Callable[[SessionStore, str], object]] = {
    "touch": lambda store, key: store.get_or_create_session(SOURCE),
    "metadata": lambda store, key: store.set_session_metadata(key, "topic", "kept"),
    "suspension": lambda store, key: store.suspend_session(key),
    "resume flag": lambda store, key: store.mark_resume_pending(key, "restart_timeout"),
    "counters": lambda store, key: store.update_session(key, input_tokens=5),
}
"""Writes a process makes from its cached entry of a lane."""

EFFECTS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "touch": lambda entry: True,
    "metadata": lambda entry: entry["metadata"] == {"topic": "kept"},
    "suspension": lambda entry: entry["suspended"] is True,
    "resume flag": lambda entry: entry["resume_pending"] is True,
    "counters": lambda entry: entry["input_tokens"] == 5,
}
"""What each write must leave in the stored entry."""


@pytest.mark.slow
@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_from_a_stale_cache_keeps_the_new_session_made_elsewhere(
    stores: Callable[..., SessionStore], empty_database: str, write: str
) -> None:
    here, there = stores("here"), stores("there")
    old = here.get_or_create_session(SOURCE)  # cached here
    key = old.session_key
    new = there.reset_session(key)  # /new through the other process
    assert new is not None
    WRITES[write](here, key)  # from the cached entry, stale now
    entry, sessions = _stored(empty_database, key)
    assert entry["session_id"] == new.session_id  # the reset elsewhere holds
    assert EFFECTS[write](entry)  # the write was made on the entry as it is now
    assert sessions == [(old.session_id, "session_reset"), (new.session_id, None)]
    current = here.lookup_by_session_key(key)
    assert current is not None
    assert current.session_id == new.session_id  # the stale copy was dropped


def test_a_row_pruned_and_created_again_is_not_taken_for_the_cached_one(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    """A new row starts at a random revision, not at the first revision of the row it
    replaces: a write from a copy cached before the prune fails its check and is redone."""
    here, there = stores("here"), stores("there")
    old = here.get_or_create_session(SOURCE)  # cached here at the row's first revision
    key = old.session_key
    run_sql(  # idle for long: due for pruning
        empty_database, "UPDATE gateway_routing SET updated_at = 0 WHERE session_key = :key",
        key=key,
    )  # fmt: skip
    assert there.prune_old_entries(1) == 1
    new = there.get_or_create_session(SOURCE, force_new=True)  # the lane's row, created again
    assert new.session_id != old.session_id
    assert here.set_session_metadata(key, "topic", "kept")  # from the copy cached before
    entry, _ = _stored(empty_database, key)
    assert entry["session_id"] == new.session_id
    assert entry["metadata"] == {"topic": "kept"}


def test_a_reset_from_a_stale_cache_resets_the_session_made_elsewhere(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    here, there = stores("here"), stores("there")
    old = here.get_or_create_session(SOURCE)
    key = old.session_key
    theirs = there.reset_session(key)
    assert theirs is not None
    ours = here.reset_session(key)  # as if it came after the other process's reset
    assert ours is not None
    assert ours.prev_session_id == theirs.session_id
    entry, sessions = _stored(empty_database, key)
    assert entry["session_id"] == ours.session_id
    assert sessions == [
        (old.session_id, "session_reset"), (theirs.session_id, "session_reset"),
        (ours.session_id, None),
    ]  # fmt: skip


def test_two_processes_opening_a_new_lane_at_once_share_one_session(
    stores: Callable[..., SessionStore], empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here, there = stores("here"), stores("there")
    theirs: list[SessionEntry] = []
    newest = here._backing.backend.newest_session

    def other_first(key: str) -> Any:
        """The other process creates the lane between this one's read and its write."""
        if not theirs:
            theirs.append(there.get_or_create_session(SOURCE))
        return newest(key)

    monkeypatch.setattr(here._backing.backend, "newest_session", other_first)
    ours = here.get_or_create_session(SOURCE)
    assert theirs
    assert ours.session_id == theirs[0].session_id
    entry, sessions = _stored(empty_database, ours.session_key)
    assert entry["session_id"] == ours.session_id
    assert sessions == [(ours.session_id, None)]


@pytest.mark.slow
def test_a_lane_changed_elsewhere_on_every_attempt_raises_and_writes_nothing(
    stores: Callable[..., SessionStore], empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here, there = stores("here"), stores("there")
    key = here.get_or_create_session(SOURCE).session_key
    put_route = here._backing.backend.put_route
    attempts: list[int] = []

    def other_first(entry: Any, *, touch: bool = False) -> None:
        """The other process writes the lane between each read and write of this one."""
        attempts.append(len(attempts))
        there.set_session_metadata(key, "theirs", attempts[-1])
        put_route(entry, touch=touch)

    monkeypatch.setattr(here._backing.backend, "put_route", other_first)
    with pytest.raises(RoutingConflictError, match="changed by another gateway process"):
        here.set_session_metadata(key, "ours", 1)
    assert len(attempts) >= 3  # (the writer runs a failed step once more on its own)
    entry, _ = _stored(empty_database, key)
    assert entry["metadata"] == {"theirs": attempts[-1]}  # each attempt was overtaken


def test_a_processs_own_turn_writes_never_count_as_a_conflict(
    stores: Callable[..., SessionStore], empty_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The cached revision follows this process's own unchecked writes (a turn's marker)."""
    store = stores("here", lease_secs=60)
    key = store.get_or_create_session(SOURCE).session_key
    assert store._leases.take_lease(key)
    caplog.set_level(logging.DEBUG, logger="hermes_core.store.routing")
    for _turn in range(2):
        token = store.mark_turn_active(key)
        assert token is not None
        store.update_session(key, input_tokens=1)
        assert store.clear_turn_active(key, token)
        assert store.set_session_metadata(key, "turns", _turn)
    assert not [record for record in caplog.records if "redoing" in record.getMessage()]
    entry, _ = _stored(empty_database, key)
    assert entry["input_tokens"] == 2
    assert entry["metadata"] == {"turns": 1}


def _one_turn(store: SessionStore, key: str) -> None:
    """One turn of the lane under a lease taken and given back (the runtime's writes)."""
    assert store._leases.take_lease(key)
    token = store.mark_turn_active(key)
    assert token is not None
    assert store.clear_turn_active(key, token)
    assert store._leases.release_lease(key) is None


@pytest.mark.slow
@pytest.mark.parametrize("change", ["new", "metadata", "counters"])
def test_a_lease_taken_again_sees_what_another_process_wrote_in_between(
    stores: Callable[..., SessionStore], change: str
) -> None:
    here, there = stores("here", lease_secs=60), stores("there", lease_secs=60)
    old = here.get_or_create_session(SOURCE)
    key = old.session_key
    _one_turn(here, key)  # the entry stays cached here, at the row's revision
    if change == "new":
        assert there.reset_session(key) is not None
    elif change == "metadata":
        assert there.set_session_metadata(key, "topic", "theirs")
    else:
        there.update_session(key, input_tokens=7)
    assert here._leases.take_lease(key)
    entry = here.lookup_by_session_key(key)
    assert entry is not None
    theirs = there.lookup_by_session_key(key)
    assert theirs is not None
    assert entry.session_id == theirs.session_id
    assert (entry.session_id != old.session_id) == (change == "new")
    assert entry.metadata == theirs.metadata
    assert entry.input_tokens == theirs.input_tokens


def test_a_lease_taken_on_a_lane_whose_session_ended_elsewhere_keeps_no_stale_entry(
    stores: Callable[..., SessionStore], empty_database: str
) -> None:
    """The grant reads the routing row with its session's end: a row pointing at an ended
    session is a stale route, cached as no entry (the lane's next message opens a session)."""
    here = stores("here", lease_secs=60)
    entry = here.get_or_create_session(SOURCE)  # cached here
    # another writer ends the session and touches the row
    run_sql(empty_database, "UPDATE sessions SET end_reason = 'idle' WHERE id = :id",
            id=entry.session_id)  # fmt: skip
    run_sql(
        empty_database,
        "UPDATE gateway_routing SET revision = revision + 1 WHERE session_key = :key",
        key=entry.session_key,
    )
    assert here._leases.take_lease(entry.session_key) == "free"
    assert here.lookup_by_session_key(entry.session_key) is None
