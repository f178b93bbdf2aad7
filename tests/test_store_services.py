"""The store's services on their own, over the SQLite backend: each is built from the parts its
constructor names, without the SessionStore facade."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from hermes_core import GatewayConfig
from hermes_core.domain.errors import InvalidValueError, MessageRedeliveredError
from hermes_core.domain.models import MessageEvent, SessionEntry
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.state.files import ensure_private_dir
from hermes_core.store import queue_rows
from hermes_core.store.backing import Backing
from hermes_core.store.entries import EntryCache
from hermes_core.store.mirror import MIRROR_FILENAME, MirrorWriter
from hermes_core.store.queue_rows import QueueRows
from hermes_core.store.routing import RoutingTable
from hermes_core.store.sessions import Sessions
from hermes_core.store.writer import StoreWriter
from hermes_core.testing import fresh_plugin_manager, telegram_dm

LANE = "agent:main:telegram:dm:c=99"
OTHER = "agent:main:telegram:dm:c=7"


@dataclass
class Parts:
    """What every service of a store is built on."""

    config: GatewayConfig
    plugins: HermesPluginManager
    backing: Backing
    writer: StoreWriter
    routes: RoutingTable

    def sessions(self) -> Sessions:
        return Sessions(self.backing, self.routes, self.writer, self.config, self.plugins)

    def close(self) -> None:
        self.writer.close()
        self.backing.backend.close()

    def queue(self, holds: Callable[[str], bool] = lambda key: True) -> QueueRows:
        return QueueRows(
            self.backing, self.writer, self.config, self.plugins, holds, read_only=False
        )


@pytest.fixture
def opened(hermes_home: Path) -> Iterator[Callable[[], Parts]]:
    """Opens the parts over the SQLite store of ``hermes_home`` (each opening with its own
    entry cache); all are closed after the test."""
    config = GatewayConfig.from_dict(
        {"gateway": {"max_dispatch_attempts": 2}}, environ={"HERMES_HOME": str(hermes_home)}
    )
    plugins = fresh_plugin_manager(hermes_home)
    sessions_dir = ensure_private_dir(Path(config.sessions_dir))
    made: list[Parts] = []

    def open_parts() -> Parts:
        cache = EntryCache(100)
        mirror = MirrorWriter(sessions_dir / MIRROR_FILENAME)
        backing = Backing(
            config, plugins, sessions_dir, cache, mirror, read_only=False, rekeying=False
        )
        writer = StoreWriter(backing.transaction, cache.clear)
        made.append(
            Parts(config, plugins, backing, writer, RoutingTable(backing, cache, writer, plugins))
        )
        return made[-1]

    yield open_parts
    for parts in made:
        parts.close()


# -- the lane state machine -----------------------------------------------------------------------


def test_a_lane_keeps_its_session_until_a_boundary_ends_it(opened: Callable[[], Parts]) -> None:
    parts = opened()
    sessions = parts.sessions()
    first = sessions.get_or_create_session(telegram_dm())
    assert first.session_key == LANE
    assert sessions.get_or_create_session(telegram_dm()).session_id == first.session_id

    reset = sessions.reset_session(LANE)
    assert reset is not None
    assert reset.session_id != first.session_id
    assert reset.prev_session_id == first.session_id
    assert reset.is_fresh_reset
    ended = parts.routes.session_row(first.session_id)
    assert ended is not None
    assert ended.end_reason == "session_reset"

    forced = sessions.get_or_create_session(telegram_dm(), force_new=True)
    assert forced.prev_session_id == reset.session_id
    assert not forced.is_fresh_reset
    assert sessions.reset_session(OTHER) is None  # an unknown lane is not created


def test_a_suspended_lane_gets_a_new_session_with_its_next_message(
    opened: Callable[[], Parts],
) -> None:
    parts = opened()
    sessions = parts.sessions()
    first = sessions.get_or_create_session(telegram_dm())
    assert not sessions.unsuspend_session(LANE)  # not suspended: nothing to clear
    assert sessions.suspend_session(LANE)
    assert not sessions.mark_resume_pending(LANE)  # a suspended lane is not resumed

    replaced, was_suspended = sessions.open_lane(LANE, telegram_dm())
    assert was_suspended
    assert replaced.session_id != first.session_id
    assert replaced.was_auto_reset
    assert replaced.auto_reset_reason == "suspended"
    ended = parts.routes.session_row(first.session_id)
    assert ended is not None
    assert ended.end_reason == "suspended"
    assert sessions.open_lane(LANE, telegram_dm()) == (replaced, False)


def test_the_resume_flag_is_set_and_cleared_once(opened: Callable[[], Parts]) -> None:
    sessions = opened().sessions()
    assert not sessions.mark_resume_pending(LANE)  # unknown lane
    sessions.get_or_create_session(telegram_dm())
    assert not sessions.clear_resume_pending(LANE)
    assert not sessions.mark_resume_pending(LANE, only_if_running=True)  # no turn runs
    assert sessions.mark_resume_pending(LANE, "shutdown_timeout")
    assert sessions.clear_resume_pending(LANE)
    assert not sessions.clear_resume_pending(LANE)


def test_each_change_is_stored_before_it_is_cached(opened: Callable[[], Parts]) -> None:
    """The next opening, with an empty cache of its own, reads what the first one changed."""
    writer_side = opened()
    sessions = writer_side.sessions()
    entry = sessions.get_or_create_session(telegram_dm())
    sessions.update_session(LANE, input_tokens=5, output_tokens=2, touch_activity=False)
    assert sessions.set_session_metadata(LANE, "mood", {"calm": True})
    assert sessions.mark_resume_pending(LANE)
    writer_side.close()  # idempotent: the fixture closes it again

    reader = opened().routes.lookup_by_session_key(LANE)
    assert reader is not None
    assert reader.session_id == entry.session_id
    assert (reader.input_tokens, reader.output_tokens, reader.total_tokens) == (5, 2, 7)
    assert reader.metadata == {"mood": {"calm": True}}
    assert reader.resume_pending
    assert reader.resume_reason == "restart_timeout"


def test_a_refused_change_writes_nothing(opened: Callable[[], Parts]) -> None:
    parts = opened()
    sessions = parts.sessions()
    sessions.get_or_create_session(telegram_dm())
    sessions.update_session(LANE, input_tokens=2**63 - 10)
    with pytest.raises(InvalidValueError, match="64-bit"):
        sessions.update_session(LANE, input_tokens=20)
    with pytest.raises(InvalidValueError, match="65536-byte limit"):
        sessions.set_session_metadata(LANE, "big", "x" * 70_000)
    entry = parts.routes.lookup_by_session_key(LANE)
    assert entry is not None
    assert entry.input_tokens == 2**63 - 10
    assert entry.metadata == {}


# -- the durable queue's rows ---------------------------------------------------------------------


def event(text: str, message_id: str | None = None, chat: str = "99") -> MessageEvent:
    return MessageEvent(source=telegram_dm(chat), text=text, message_id=message_id)


def test_queued_events_come_back_per_lane_oldest_first(opened: Callable[[], Parts]) -> None:
    rows = opened().queue()
    first = rows.add(LANE, event("one", "m1"))
    rows.add(OTHER, event("elsewhere", "m2", chat="7"))
    second = rows.add(LANE, event("two", "m3"))
    assert first is not None
    assert second is not None
    assert first < second
    assert [(i, e.text) for i, _, e in rows.restore(LANE)] == [(first, "one"), (second, "two")]
    assert [key for _, key, _ in rows.restore()] == [LANE, OTHER, LANE]
    assert rows.remove([first]) == 1
    assert [e.text for _, _, e in rows.restore(LANE)] == ["two"]


def test_all_lanes_restored_are_only_those_held(opened: Callable[[], Parts]) -> None:
    rows = opened().queue(holds=lambda key: key == OTHER)
    rows.add(LANE, event("not mine"))
    rows.add(OTHER, event("mine", chat="7"))
    assert [e.text for _, _, e in rows.restore()] == ["mine"]
    assert [e.text for _, _, e in rows.restore(LANE)] == ["not mine"]  # asked for by name


def test_a_message_seen_before_is_refused_until_the_window_passed(
    opened: Callable[[], Parts], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = opened().queue()
    rows.add(LANE, event("hi", "m1"))
    with pytest.raises(MessageRedeliveredError):
        rows.add(LANE, event("hi again", "m1"))
    assert [e.text for _, _, e in rows.restore(LANE)] == ["hi"]  # nothing written
    internal = MessageEvent(source=telegram_dm(), text="wake", internal=True, message_id="m1")
    assert rows.add(LANE, internal) is not None  # internal events are not remembered

    assert rows.prune_seen() == 0  # seen just now: inside the 7-day window
    later = time.time() + 8 * 86_400
    monkeypatch.setattr(queue_rows, "time", SimpleNamespace(time=lambda: later))
    assert rows.prune_seen() == 1
    assert rows.add(LANE, event("hi", "m1")) is not None


def test_an_event_that_keeps_failing_to_start_becomes_a_dead_letter(
    opened: Callable[[], Parts],
) -> None:
    rows = opened().queue()  # gateway.max_dispatch_attempts: 2
    event_id = rows.add(LANE, event("boom", "m1"))
    assert not rows.fail(event_id, "first")
    assert rows.dead_letters() == []
    assert rows.fail(event_id, "second")
    [letter] = rows.dead_letters()
    assert (letter.event_id, letter.session_key) == (event_id, LANE)
    assert (letter.attempts, letter.last_error) == (2, "second")
    assert rows.restore(LANE) == []  # set aside, not restored
    assert not rows.fail(None, "an event never stored")


# -- the entry cache ------------------------------------------------------------------------------


def entry(key: str) -> SessionEntry:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return SessionEntry(
        session_key=key, session_id="20260101_000000_0a1b2c3d", created_at=now, updated_at=now
    )


def test_a_shared_store_caches_an_entry_only_with_its_revision() -> None:
    cache = EntryCache(2)
    cache.put(LANE, entry(LANE), None, shared=True)
    assert cache.get(LANE) is None  # its row's revision is not known: read it afresh
    cache.put(LANE, entry(LANE), 5, shared=True)
    assert cache.get(LANE) is not None
    assert cache.cached_revision(LANE) == 5
    cache.put(LANE, None, 6, shared=True)  # no entry (a stale route), the revision kept
    assert cache.get(LANE) is None
    assert cache.revision(LANE) == 6
    assert cache.cached_revision(LANE) is None

    single = EntryCache(2)
    single.put(LANE, entry(LANE), None, shared=False)
    assert single.get(LANE) is not None
    assert single.revision(LANE) is None


def test_an_entry_dropped_from_the_cache_takes_its_revision_along() -> None:
    cache = EntryCache(2)
    for revision, key in enumerate([LANE, OTHER, "agent:main:telegram:dm:c=5"]):
        cache.put(key, entry(key), revision, shared=True)
    assert cache.get(LANE) is None
    assert cache.revision(LANE) is None  # least recently used
    assert cache.revision(OTHER) == 1
    before = cache.routing_revision
    cache.routing_changed()
    assert cache.routing_revision == before + 1
    cache.clear()
    assert cache.get(OTHER) is None
    assert cache.revision(OTHER) is None
