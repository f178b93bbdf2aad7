"""TurnQueue: slot and overflow, cap, burst and album merges, discards, persistence."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig
from hermes_core.domain.errors import StoreError
from hermes_core.domain.models import MessageEvent, MessageType
from hermes_core.domain.specs import LifecycleEvent
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.turns.queue import MERGED_KEY, QueuedItem, SeenMessages, TurnQueue

LANE = "agent:main:telegram:dm:99"
OTHER = "agent:main:telegram:dm:42"


class Clock:
    """A manual monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def open_store(home: Path) -> SessionStore:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


def blocked_store(home: Path) -> SessionStore:
    """A degraded (JSONL) store: its SQLite directory ``<home>/db`` is a regular file."""
    home.mkdir(parents=True, mode=0o700)
    (home / "db").write_text("not a directory")
    settings = {"storage": {"url": f"sqlite:///{home}/db/state.db"}}
    config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})
    return SessionStore.open(config, plugins=fresh_plugin_manager(home))


@pytest.fixture
def store(hermes_home: Path) -> Iterator[SessionStore]:
    opened = open_store(hermes_home)
    yield opened
    opened.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def seen() -> list[LifecycleEvent]:
    return []


def make_queue(
    store: SessionStore,
    clock: Clock,
    seen: list[LifecycleEvent] | None = None,
    **busy_queue: Any,
) -> TurnQueue:
    config = GatewayConfig.from_dict({"gateway": {"busy_queue": busy_queue}}, environ={})
    return TurnQueue(store, config, clock=clock, notify=None if seen is None else seen.append)


@pytest.fixture
def queue(store: SessionStore, clock: Clock, seen: list[LifecycleEvent]) -> TurnQueue:
    return make_queue(store, clock, seen)


def msg(
    text: str = "hi",
    user: str | None = "u1",
    kind: MessageType = MessageType.TEXT,
    media: tuple[str, ...] = (),
    alt: str | None = None,
    **fields: Any,
) -> MessageEvent:
    source = telegram_dm(user_id=user, user_id_alt=alt)
    return MessageEvent(source=source, text=text, message_type=kind, media_urls=media, **fields)


def wake(text: str = "done") -> MessageEvent:
    return MessageEvent(source=telegram_dm(), text=text, internal=True, bound_session_id="s1")


def texts(queue: TurnQueue, key: str = LANE) -> list[str]:
    """Pop every item of the lane; their texts, head first."""
    items = []
    while (item := queue.pop_head(key)) is not None:
        items.append(item.event.text)
    return items


def event_ids(items: list[QueuedItem]) -> list[int]:
    """The items' durable ids (each must have one)."""
    ids = [item.event_id for item in items if item.event_id is not None]
    assert len(ids) == len(items)
    return ids


def restored_items(store: SessionStore, key: str = LANE) -> list[QueuedItem]:
    """The lane's items as a restart restores them from the store."""
    queue = TurnQueue(store, GatewayConfig.from_dict({}, environ={}))
    queue.restore()
    return queue.items(key)


def stored(store: SessionStore, key: str = LANE) -> list[str]:
    """The lane's persisted texts, in durable order."""
    return [item.event.text for item in restored_items(store, key)]


# -- order, depth, cap -----------------------------------------------------------------------------


def test_items_queue_in_arrival_order_with_increasing_ids(
    queue: TurnQueue, store: SessionStore
) -> None:
    for depth, user in enumerate(("a", "b", "c"), start=1):
        result = queue.enqueue(LANE, msg(user, user=user))
        assert (result.accepted, result.merged, result.depth, result.refused) == (
            True, False, depth, None,
        )  # fmt: skip
    assert queue.depth(LANE) == 3
    assert queue.depth(OTHER) == 0
    head = queue.head(LANE)
    assert head is not None
    assert (head.event.text, head.humans, head.restored) == ("a", 1, False)
    ids = event_ids(queue.items(LANE))
    assert ids == sorted(ids)
    assert ids == [event_id for event_id, _, _ in store._queue.restore()]
    assert stored(store) == ["a", "b", "c"]
    assert texts(queue) == ["a", "b", "c"]
    assert queue.depth(LANE) == 0
    assert queue.head(LANE) is None
    assert queue.lanes() == []


def test_cap_refuses_without_storing_but_still_merges(
    store: SessionStore, clock: Clock, seen: list[LifecycleEvent]
) -> None:
    queue = make_queue(store, clock, seen, max_pending=2)
    queue.enqueue(LANE, msg("a", user="a"))
    queue.enqueue(LANE, msg("b", user="b"))
    refused = queue.enqueue(LANE, msg("c", user="c"))
    assert (refused.accepted, refused.merged, refused.depth, refused.refused) == (
        False, False, 2, "cap",
    )  # fmt: skip
    assert queue.enqueue(LANE, wake()).refused == "cap"
    assert queue.depth(LANE) == 2
    assert stored(store) == ["a", "b"]
    merged = queue.enqueue(LANE, msg("b2", user="b"))
    assert (merged.accepted, merged.merged, merged.depth) == (True, True, 2)
    assert stored(store) == ["a", "b\nb2"]
    assert seen[2].kind == "queue_refused"
    assert dict(seen[2].detail) == {"reason": "cap", "depth": 2}


def test_the_total_across_lanes_is_capped_too(store: SessionStore, clock: Clock) -> None:
    """``max_pending`` may be huge; ``max_total`` still bounds what all lanes hold in memory."""
    queue = make_queue(store, clock, max_pending=1_000_000, max_total=3)
    for key, text in ((LANE, "a"), (LANE, "b"), (OTHER, "c")):
        assert queue.enqueue(key, msg(text, user=text)).accepted
    refused = queue.enqueue(OTHER, msg("d", user="d"))
    assert (refused.accepted, refused.depth, refused.refused) == (False, 1, "full")
    assert queue.enqueue(LANE, wake()).refused == "full"
    assert queue.enqueue(OTHER, msg("c2", user="c")).merged  # a merge adds no item
    assert queue.total() == 3
    assert stored(store) == ["a", "b"]
    assert stored(store, OTHER) == ["c\nc2"]
    assert texts(queue, LANE) == ["a", "b"]  # nothing accepted was lost, in order
    assert queue.enqueue(OTHER, msg("e", user="e")).accepted  # room again
    assert texts(queue, OTHER) == ["c\nc2", "e"]


@pytest.mark.slow
def test_memory_stays_bounded_however_many_messages_are_queued(
    store: SessionStore, clock: Clock
) -> None:
    """3,000 messages for a lane whose own cap would take them all: the queue holds
    ``max_total`` of them, and its memory grows by that many items, not by 3,000."""
    import gc
    import tracemalloc

    queue = make_queue(store, clock, max_pending=1_000_000, max_total=100, burst_window_secs=0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        accepted = sum(queue.enqueue(LANE, msg(f"message {n} " + "x" * 1000)).accepted
                       for n in range(3000))  # fmt: skip
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert accepted == queue.total() == 100
    assert grown < 100 * 8 * 1024, grown  # ~2-3 KB an item; 3,000 items would be ~8 MB
    assert texts(queue) == [f"message {n} " + "x" * 1000 for n in range(100)]


# -- burst collapse and album merge ---------------------------------------------------------------


def test_burst_from_one_participant_collapses_into_one_item(
    queue: TurnQueue, store: SessionStore, clock: Clock
) -> None:
    queue.enqueue(LANE, msg("one"))
    for text in ("two", "three"):
        clock.advance(1.5)  # each gap is measured from the last arrival, not the first
        result = queue.enqueue(LANE, msg(text))
        assert (result.accepted, result.merged, result.depth) == (True, True, 1)
    head = queue.head(LANE)
    assert head is not None
    assert head.event.text == "one\ntwo\nthree"
    assert (head.humans, head.last_arrival) == (3, clock.now)
    assert stored(store) == ["one\ntwo\nthree"]


def test_window_boundary_is_inclusive(queue: TurnQueue, clock: Clock) -> None:
    queue.enqueue(LANE, msg("one"))
    clock.advance(2.0)
    assert queue.enqueue(LANE, msg("two")).merged


def test_alternate_user_id_identifies_the_participant(queue: TurnQueue) -> None:
    queue.enqueue(LANE, msg("one", user="x", alt="same"))
    assert queue.enqueue(LANE, msg("two", user="y", alt="same")).merged
    assert not queue.enqueue(LANE, msg("three", user="y", alt="other")).merged


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(msg("a", user="u1"), msg("b", user="u2"), id="other-participant"),
        pytest.param(msg("a", user=None), msg("b", user=None), id="no-participant"),
        pytest.param(msg("a"), msg("b", queued_via_command=True), id="queue-command-new"),
        pytest.param(msg("a", queued_via_command=True), msg("b"), id="queue-command-tail"),
        pytest.param(msg("a"), msg("b", internal=True), id="internal-new"),
        pytest.param(msg("a", internal=True), msg("b", internal=True), id="internal-both"),
        pytest.param(msg("a", internal=True), msg("b"), id="internal-tail"),
        pytest.param(msg("a", kind=MessageType.PHOTO, media=("p",)), msg("b"), id="text-to-photo"),
        pytest.param(msg("a", media=("link",)), msg("b"), id="text-with-media"),
        *(
            pytest.param(msg("a"), msg("b", kind=kind, media=("m",)), id=kind.value)
            for kind in (
                MessageType.VOICE,
                MessageType.VIDEO,
                MessageType.AUDIO,
                MessageType.DOCUMENT,
                MessageType.STICKER,
                MessageType.LOCATION,
            )
        ),
        pytest.param(
            msg("a", kind=MessageType.VOICE, media=("v",)),
            msg("b", kind=MessageType.PHOTO, media=("p",)),
            id="photo-to-voice",
        ),
    ],
)
def test_events_that_never_merge(
    queue: TurnQueue, first: MessageEvent, second: MessageEvent
) -> None:
    queue.enqueue(LANE, first)
    result = queue.enqueue(LANE, second)
    assert (result.accepted, result.merged, result.depth) == (True, False, 2)
    assert texts(queue) == ["a", "b"]


def test_no_merge_after_the_window(queue: TurnQueue, clock: Clock) -> None:
    queue.enqueue(LANE, msg("a"))
    clock.advance(2.01)
    assert not queue.enqueue(LANE, msg("b")).merged
    assert queue.depth(LANE) == 2


def test_zero_window_disables_merging(store: SessionStore, clock: Clock) -> None:
    queue = make_queue(store, clock, burst_window_secs=0)
    queue.enqueue(LANE, msg("a"))
    assert not queue.enqueue(LANE, msg("b")).merged
    assert queue.depth(LANE) == 2


def test_merges_only_into_the_tail(queue: TurnQueue) -> None:
    queue.enqueue(LANE, msg("a1", user="a"))
    queue.enqueue(LANE, msg("b1", user="b"))
    assert not queue.enqueue(LANE, msg("a2", user="a")).merged  # never ahead of b1
    assert queue.enqueue(LANE, msg("a3", user="a")).merged
    assert texts(queue) == ["a1", "b1", "a2\na3"]


def test_album_merges_photos_into_a_text(queue: TurnQueue, store: SessionStore) -> None:
    queue.enqueue(LANE, msg("look at these"))
    photo = MessageType.PHOTO
    assert queue.enqueue(LANE, msg("", kind=photo, media=("p1",))).merged
    assert queue.enqueue(LANE, msg("second caption", kind=photo, media=("p2", "p3"))).merged
    head = queue.head(LANE)
    assert head is not None
    assert head.event.message_type is MessageType.PHOTO
    assert head.event.media_urls == ("p1", "p2", "p3")
    assert head.event.text == "look at these\nsecond caption"
    assert head.humans == 3
    (persisted,) = (item.event for item in restored_items(store))
    assert persisted.media_urls == ("p1", "p2", "p3")
    assert persisted.message_type is MessageType.PHOTO


def test_album_merges_photos_with_captions(queue: TurnQueue) -> None:
    photo = MessageType.PHOTO
    queue.enqueue(LANE, msg("cap one", kind=photo, media=("p1",)))
    result = queue.enqueue(LANE, msg("cap two", kind=photo, media=("p2",)))
    assert (result.merged, result.depth) == (True, 1)
    head = queue.head(LANE)
    assert head is not None
    assert (head.event.text, head.event.media_urls) == ("cap one\ncap two", ("p1", "p2"))


def test_merged_item_keeps_the_first_message_identity(queue: TurnQueue) -> None:
    first = msg("a", message_id="m1", metadata={"k": "v"})
    queue.enqueue(LANE, first)
    queue.enqueue(LANE, msg("b", message_id="m2"))
    head = queue.head(LANE)
    assert head is not None
    assert (head.event.event_id, head.event.message_id) == (first.event_id, "m1")
    assert head.event.metadata == {"k": "v", MERGED_KEY: 2}


def test_merged_content_survives_reopening_the_store(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    queue = make_queue(store, clock)
    for text in ("one", "two", "three"):
        queue.enqueue(LANE, msg(text))
    store.close()
    reopened = open_store(hermes_home)
    try:
        assert stored(reopened) == ["one\ntwo\nthree"]
        restored = make_queue(reopened, clock)
        assert restored.restore() == 1
        assert restored.discard_slot(LANE) == 3  # the merge count survives the restart
    finally:
        reopened.close()


# -- burst bounds and the cost of a merge ---------------------------------------------------------


def reopened_queue(home: Path, store: SessionStore, clock: Clock) -> tuple[SessionStore, TurnQueue]:
    """Close the store, open it again and restore a queue from it (a restart)."""
    store.close()
    reopened = open_store(home)
    queue = make_queue(reopened, clock)
    queue.restore()
    return reopened, queue


def test_a_burst_past_the_part_bound_starts_a_new_item_and_survives_a_restart(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    queue = make_queue(store, clock, burst_max_parts=3)
    merged = [queue.enqueue(LANE, msg(f"m{n}", message_id=f"p{n}")).merged for n in range(7)]
    assert merged == [False, True, True, False, True, True, False]
    expected = ["m0\nm1\nm2", "m3\nm4\nm5", "m6"]
    assert [item.event.text for item in queue.items(LANE)] == expected
    reopened, restored = reopened_queue(hermes_home, store, clock)
    try:
        items = restored.items(LANE)
        assert [item.event.text for item in items] == expected
        assert [item.humans for item in items] == [3, 3, 1]
        assert [item.event.metadata.get(MERGED_KEY) for item in items] == [3, 3, None]
        assert [item.event.message_id for item in items] == ["p0", "p3", "p6"]
        assert restored.discard_humans(LANE) == 7
        assert stored(reopened) == []
    finally:
        reopened.close()


def test_a_burst_past_the_byte_bound_starts_a_new_item_and_survives_a_restart(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    queue = make_queue(store, clock, burst_max_bytes=1024)
    chunks = ["a" * 400, "é" * 200, "b" * 224, "c" * 1, "d" * 2000, "e"]  # é is 2 bytes
    merged = [queue.enqueue(LANE, msg(chunk)).merged for chunk in chunks]
    # 400 + 400 + 224 = 1024 fits; one byte more does not; an oversized message is queued
    # whole but takes no follow-ups.
    assert merged == [False, True, True, False, False, False]
    expected = ["\n".join(chunks[:3]), chunks[3], chunks[4], chunks[5]]
    assert [item.event.text for item in queue.items(LANE)] == expected
    reopened, restored = reopened_queue(hermes_home, store, clock)
    try:
        assert [item.event.text for item in restored.items(LANE)] == expected
        assert [item.humans for item in restored.items(LANE)] == [3, 1, 1, 1]
    finally:
        reopened.close()


def test_the_joined_event_follows_each_merge_and_undo(queue: TurnQueue) -> None:
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(LANE, msg("b"))
    head = queue.head(LANE)
    assert head is not None
    assert head.event.text == "a\nb"  # joined and cached
    queue.enqueue(LANE, msg("c"))
    assert (head.event.text, head.event.metadata[MERGED_KEY]) == ("a\nb\nc", 3)
    head.take_back(head.last_arrival)
    assert (head.event.text, head.event.metadata[MERGED_KEY]) == ("a\nb", 2)


def test_media_urls_count_towards_the_byte_bound(store: SessionStore, clock: Clock) -> None:
    queue = make_queue(store, clock, burst_max_bytes=1024)
    photo = MessageType.PHOTO
    queue.enqueue(LANE, msg("", kind=photo, media=("u" * 600,)))
    assert not queue.enqueue(LANE, msg("", kind=photo, media=("v" * 600,))).merged
    assert queue.depth(LANE) == 2


def test_a_merge_writes_only_the_new_message(
    store: SessionStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each follow-up costs one store call carrying that message alone, never the burst."""
    calls: list[tuple[str, int]] = []
    for name in ("add", "remove", "fail"):
        real = getattr(store._queue, name)

        def spy(*args: Any, _name: str = name, _real: Any = real) -> Any:
            events = [arg for arg in args if isinstance(arg, MessageEvent)]
            calls.append((_name, sum(len(json.dumps(e.to_dict())) for e in events)))
            return _real(*args)

        monkeypatch.setattr(store._queue, name, spy)
    follow_ups, body = 200, "x" * 1000
    queue = make_queue(store, clock, burst_max_parts=1000, burst_max_bytes=16 * 1024 * 1024)
    for n in range(follow_ups + 1):
        assert queue.enqueue(LANE, msg(f"{n:03} {body}")).merged == (n > 0)
    assert [name for name, _ in calls] == ["add"] * (follow_ups + 1)
    single = len(json.dumps(msg(f"000 {body}").to_dict()))
    assert max(size for _, size in calls) < single + 100  # the follow-up row's marker
    (item,) = queue.items(LANE)
    assert item.humans == follow_ups + 1
    assert len(item.event.text) == (follow_ups + 1) * (len(body) + 5) - 1


async def test_a_merge_rolled_back_with_its_batch_counts_once(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    """Another caller's failing step rolls back the batch holding a merge: the merge is undone
    in memory and runs again on its own, so memory and store both hold it once."""
    queue = make_queue(store, clock)
    queue.enqueue(LANE, msg("a"))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    def fail() -> None:
        raise RuntimeError("another caller's step failed")

    held = store.submit(hold)
    await asyncio.to_thread(holding.wait, 30)
    merge = store.submit(queue.enqueue, LANE, msg("b"))  # the next batch: merge and fail
    failing = store.submit(fail)
    release.set()
    await held
    assert (await merge).merged
    with pytest.raises(RuntimeError):
        await failing
    (item,) = queue.items(LANE)
    assert (item.event.text, item.humans, len(item.follow_ups)) == ("a\nb", 2, 1)
    reopened, restored = reopened_queue(hermes_home, store, clock)
    try:
        assert [(i.event.text, i.humans) for i in restored.items(LANE)] == [("a\nb", 2)]
    finally:
        reopened.close()


def test_a_follow_up_row_without_its_item_is_restored_alone(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    queue = make_queue(store, clock)
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(LANE, msg("b", metadata={"k": "v"}))
    head = queue.head(LANE)
    assert head is not None
    assert head.event_id is not None
    store._queue.remove([head.event_id])
    reopened, restored = reopened_queue(hermes_home, store, clock)
    try:
        (item,) = restored.items(LANE)
        assert (item.event.text, item.humans, item.event.metadata) == ("b", 1, {"k": "v"})
    finally:
        reopened.close()


# -- discards --------------------------------------------------------------------------------------


def test_stop_discards_the_slot_burst_and_promotes_the_overflow(
    queue: TurnQueue, store: SessionStore, seen: list[LifecycleEvent]
) -> None:
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(LANE, msg("b"))
    queue.enqueue(LANE, msg("queued", queued_via_command=True))
    queue.enqueue(LANE, wake("w"))
    queue.enqueue(LANE, msg("c", user="u2"))
    assert queue.discard_slot(LANE) == 2
    assert stored(store) == ["queued", "w", "c"]
    assert seen[-1].kind == "queue_discarded"
    assert dict(seen[-1].detail) == {"scope": "slot", "items": 1, "messages": 2, "depth": 3}
    assert queue.discard_slot(LANE) == 0  # a /queue item in the slot owes its turn
    assert queue.depth(LANE) == 3
    assert texts(queue) == ["queued", "w", "c"]


def test_stop_keeps_an_internal_slot_and_handles_an_empty_lane(
    queue: TurnQueue, seen: list[LifecycleEvent]
) -> None:
    assert queue.discard_slot(LANE) == 0
    queue.enqueue(LANE, wake("w"))
    queue.enqueue(LANE, msg("a"))
    assert queue.discard_slot(LANE) == 0
    assert texts(queue) == ["w", "a"]
    assert "queue_discarded" not in [event.kind for event in seen]


def test_reset_discards_every_human_item_and_keeps_wakes_in_order(
    queue: TurnQueue, store: SessionStore, seen: list[LifecycleEvent]
) -> None:
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(LANE, msg("a2"))
    queue.enqueue(LANE, wake("w1"))
    queue.enqueue(LANE, msg("q", queued_via_command=True))
    queue.enqueue(LANE, wake("w2"))
    queue.enqueue(LANE, msg("b", user="u2"))
    queue.enqueue(OTHER, msg("elsewhere"))
    assert queue.discard_humans(LANE) == 4
    assert dict(seen[-1].detail) == {"scope": "humans", "items": 3, "messages": 4, "depth": 2}
    assert stored(store) == ["w1", "w2"]
    assert stored(store, OTHER) == ["elsewhere"]
    assert queue.discard_humans(LANE) == 0
    assert texts(queue) == ["w1", "w2"]


def test_failed_discard_keeps_the_items(
    queue: TurnQueue, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.enqueue(LANE, msg("a"))

    def broken(event_ids: list[int]) -> int:
        raise StoreError("disk full")

    monkeypatch.setattr(store._queue, "remove", broken)
    with pytest.raises(StoreError):
        queue.discard_slot(LANE)
    assert queue.depth(LANE) == 1


# -- dispatch helpers ------------------------------------------------------------------------------


async def test_a_head_taken_in_a_rolled_back_batch_returns_to_the_slot(
    queue: TurnQueue, store: SessionStore
) -> None:
    """Another caller's failing step rolls back the batch that took a lane's head: the head is
    put back in the slot and taken again when the step runs on its own, so it is taken once."""
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(OTHER, msg("x"))
    queue.enqueue(LANE, msg("b", user="u2"))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    def fail() -> None:
        raise RuntimeError("another caller's step failed")

    held = store.submit(hold)
    await asyncio.to_thread(holding.wait, 30)
    taken = store.submit(queue.pop_head, LANE)  # the next batch: take the head, then fail
    failing = store.submit(fail)
    release.set()
    await held
    item = await taken
    with pytest.raises(RuntimeError):
        await failing
    assert item is not None
    assert item.event.text == "a"
    assert queue.lanes() == [OTHER, LANE]  # ordered by the oldest item's arrival
    assert texts(queue) == ["b"]


def test_pop_head_does_not_touch_the_store(queue: TurnQueue, store: SessionStore) -> None:
    queue.enqueue(LANE, msg("a"))
    assert queue.pop_head(LANE) is not None
    assert queue.pop_head(LANE) is None
    assert stored(store) == ["a"]  # deleted by mark_turn_active, not by the queue


# -- restore ---------------------------------------------------------------------------------------


def test_restore_reloads_lanes_in_order_and_never_merges_them(
    hermes_home: Path, store: SessionStore, clock: Clock
) -> None:
    queue = make_queue(store, clock)
    queue.enqueue(LANE, msg("a1", user="a"))
    queue.enqueue(OTHER, msg("x1"))
    queue.enqueue(LANE, wake("w"))
    queue.enqueue(LANE, msg("a2", user="a"))
    queue.enqueue(OTHER, msg("x2", user="u2"))
    store.close()
    reopened = open_store(hermes_home)
    try:
        restored = make_queue(reopened, clock)
        assert restored.restore() == 5
        assert restored.lanes() == [LANE, OTHER]
        head = restored.head(LANE)
        assert head is not None
        assert (head.restored, head.humans, head.event_id is not None) == (True, 1, True)
        result = restored.enqueue(LANE, msg("a3", user="a"))  # same sender, within the window
        assert (result.merged, result.depth) == (False, 4)
        items = restored.items(LANE)
        assert [item.event.text for item in items] == ["a1", "w", "a2", "a3"]
        assert [item.humans for item in items] == [1, 0, 1, 1]
        assert [item.restored for item in items] == [True, True, True, False]
        ids = event_ids(items)
        assert ids == sorted(ids)
        assert texts(restored, OTHER) == ["x1", "x2"]
    finally:
        reopened.close()


def test_restore_refuses_a_queue_in_use(queue: TurnQueue) -> None:
    queue.enqueue(LANE, msg("a"))
    with pytest.raises(RuntimeError):
        queue.restore()
    assert queue.depth(LANE) == 1


# -- failures and degraded mode --------------------------------------------------------------------


def test_a_failed_commit_refuses_as_not_saved(
    queue: TurnQueue,
    store: SessionStore,
    seen: list[LifecycleEvent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue.enqueue(LANE, msg("kept", user="other"))

    def broken(*args: object) -> None:
        raise StoreError("database is locked")

    monkeypatch.setattr(store._queue, "add", broken)
    result = queue.enqueue(LANE, msg("lost"))
    assert (result.accepted, result.merged, result.depth, result.refused) == (
        False, False, 1, "not_saved",
    )  # fmt: skip
    assert seen[-1].kind == "queue_refused"
    assert dict(seen[-1].detail) == {"reason": "not_saved", "depth": 1}
    assert queue.enqueue(LANE, msg("merge", user="other")).refused == "not_saved"
    assert texts(queue) == ["kept"]
    assert queue.enqueue(OTHER, msg("x")).refused == "not_saved"
    assert queue.lanes() == []


def test_degraded_store_keeps_the_queue_in_memory(tmp_path: Path, clock: Clock) -> None:
    degraded = blocked_store(tmp_path / "blocked")
    try:
        assert degraded.degraded
        queue = make_queue(degraded, clock)
        assert queue.enqueue(LANE, msg("a")).accepted
        assert queue.enqueue(LANE, msg("b")).merged
        assert queue.enqueue(LANE, wake("w")).accepted
        head = queue.head(LANE)
        assert head is not None
        assert (head.event_id, head.event.text) == (None, "a\nb")
        assert degraded._queue.restore() == []
        assert queue.discard_slot(LANE) == 2
        assert texts(queue) == ["w"]
        assert queue.restore() == 0
    finally:
        degraded.close()


# -- observers and crash point --------------------------------------------------------------------


def test_observers_see_each_commit(queue: TurnQueue, seen: list[LifecycleEvent]) -> None:
    queue.enqueue(LANE, msg("a"))
    queue.enqueue(LANE, msg("b"))
    queue.enqueue(LANE, wake())
    assert [(event.kind, event.session_key, dict(event.detail)) for event in seen] == [
        ("queue_accepted", LANE, {"depth": 1, "internal": False}),
        ("queue_merged", LANE, {"depth": 1, "messages": 2}),
        ("queue_accepted", LANE, {"depth": 2, "internal": True}),
    ]


def test_a_failing_observer_does_not_break_the_queue(
    store: SessionStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: LifecycleEvent) -> None:
        raise RuntimeError("observer bug")

    config = GatewayConfig.from_dict({}, environ={})
    queue = TurnQueue(store, config, clock=clock, notify=broken)
    assert queue.enqueue(LANE, msg("a")).accepted
    assert queue.depth(LANE) == 1
    assert "observer of queue_accepted failed" in caplog.text


# -- concurrency -----------------------------------------------------------------------------------


def test_concurrent_enqueues_keep_each_lane_in_order(store: SessionStore, clock: Clock) -> None:
    threads, per_thread, shared = 8, 15, "shared"
    own = [f"lane-{n}" for n in range(threads)]
    queue = make_queue(store, clock, max_pending=threads * per_thread, burst_window_secs=0)
    results: list[bool] = []

    def produce(n: int) -> None:
        for i in range(per_thread):
            for key in (own[n], shared):
                result = queue.enqueue(key, msg(f"{n}:{i}", user=f"u{n}"))
                results.append(result.accepted and not result.merged)

    run_threads(produce, threads)
    assert results == [True] * (2 * threads * per_thread)
    assert sorted(queue.lanes()) == sorted([*own, shared])
    persisted = store._queue.restore()
    for key in [*own, shared]:
        ids = event_ids(queue.items(key))
        assert ids == sorted(ids)
        assert ids == [event_id for event_id, lane, _ in persisted if lane == key]
    for n in range(threads):
        expected = [f"{n}:{i}" for i in range(per_thread)]
        assert [item.event.text for item in queue.items(own[n])] == expected
        mine = [item.event.text for item in queue.items(shared) if item.event.text in expected]
        assert mine == expected


def test_concurrent_burst_loses_no_text(store: SessionStore, clock: Clock) -> None:
    threads, per_thread = 8, 10
    queue = make_queue(store, clock, burst_max_parts=threads * per_thread + 1)
    run_threads(
        lambda n: [queue.enqueue(LANE, msg(f"{n}:{i}")) for i in range(per_thread)], threads
    )
    (item,) = queue.items(LANE)
    assert item.humans == threads * per_thread
    lines = item.event.text.split("\n")
    assert sorted(lines) == sorted(f"{n}:{i}" for n in range(threads) for i in range(per_thread))
    for n in range(threads):
        assert [line for line in lines if line.startswith(f"{n}:")] == [
            f"{n}:{i}" for i in range(per_thread)
        ]
    assert stored(store) == [item.event.text]


def run_threads(target: Callable[[int], object], count: int) -> None:
    """Run ``target(n)`` in ``count`` threads released together; wait for all."""
    barrier = threading.Barrier(count)

    def start(n: int) -> None:
        barrier.wait()
        target(n)

    workers = [threading.Thread(target=start, args=(n,)) for n in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_seen_messages_forget_the_least_recently_noted_beyond_their_size() -> None:
    seen = SeenMessages(2)
    seen.remember(LANE, "m1")
    seen.remember(LANE, "m2")
    seen.remember(LANE, "m1")  # noted again: m2 is now the least recent
    seen.remember_event(LANE, msg(message_id="m3"))
    seen.remember_event(LANE, msg(message_id="m4", internal=True))  # internal: never noted
    assert [seen.seen_before(LANE, msg(message_id=m)) for m in ("m1", "m2", "m3", "m4")] == [
        True, False, True, False,
    ]  # fmt: skip
    assert not seen.seen_before("other", msg(message_id="m1"))
    assert not seen.seen_before(LANE, msg())  # no message id: never a redelivery
