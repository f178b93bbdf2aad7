"""The sessions.json mirror's bounds: streamed from the routing table in bounded memory, byte for
byte the document the original gateway reads, and not kept past gateway.sessions_json_max_lanes
(an old file is removed), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_core.domain.errors import StoreError
from hermes_core.store import SessionStore
from hermes_core.store.mirror import MIRROR_README, MirrorTooLargeError, MirrorWriter
from hermes_core.testing import telegram_dm

Opener = Callable[..., SessionStore]


def whole_document(entries: dict[str, Any]) -> bytes:
    """The file as the mirror was rendered before streaming: one ``json.dumps`` of it all."""
    document = {"_README": MIRROR_README, **dict(sorted(entries.items()))}
    return (json.dumps(document, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


class Entry(dict[str, Any]):
    """A routing entry whose lifetime a test can watch (plain dicts take no weak references)."""


def entry(key: str, number: int) -> Entry:
    return Entry(session_key=key, session_id=f"s-{number}", origin={"chat_name": "Zoë", "n": []})


# -- the writer ------------------------------------------------------------------------------------


def test_streamed_pairs_render_like_the_whole_document(tmp_path: Path) -> None:
    entries = {f"agent:main:telegram:dm:c={n}": entry(f"k{n}", n) for n in (10, 2, 33, 4)}
    path = tmp_path / "sessions.json"
    assert MirrorWriter(path).write(iter(sorted(entries.items())), 1)
    assert path.read_bytes() == whole_document(entries)
    assert MirrorWriter(path).write({}, 1)
    assert path.read_bytes() == whole_document({})


def test_writer_holds_no_list_of_the_entries(tmp_path: Path) -> None:
    """Each entry is released once written: the writer keeps a buffer of bytes, not entries."""
    alive: list[weakref.ref[Entry]] = []
    most = 0

    def produce() -> Iterator[tuple[str, Entry]]:
        nonlocal most
        for number in range(500):  # an entry holds no cycle: freed when its last reference goes
            most = max(most, sum(1 for ref in alive if ref() is not None))
            made = entry(f"k{number:05d}", number)
            alive.append(weakref.ref(made))
            yield made["session_key"], made

    path = tmp_path / "sessions.json"
    assert MirrorWriter(path).write(produce(), 1)
    assert most <= 2
    assert len(json.loads(path.read_bytes())) == 501


def test_pairs_out_of_order_are_refused_and_the_old_file_kept(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    writer.write({"a": entry("a", 1)}, 1)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="out of key order"):
        writer.write(iter([("b", entry("b", 2)), ("a", entry("a", 1))]), 2)
    assert path.read_bytes() == before
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


def test_more_entries_than_allowed_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sessions.json"
    writer = MirrorWriter(path)
    writer.write({"a": entry("a", 1)}, 1)
    before = path.read_bytes()
    pairs = ((f"k{n}", entry(f"k{n}", n)) for n in range(10))
    with pytest.raises(MirrorTooLargeError):
        writer.write(pairs, 2, max_entries=5)
    assert path.read_bytes() == before
    assert writer.revision == 1
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


# -- the store -------------------------------------------------------------------------------------


def mirrored(**gateway: Any) -> dict[str, Any]:
    """The gateway settings of a store that keeps the mirror (and ``gateway``)."""
    return {"write_sessions_json": True, **gateway}


# Keys whose order differs between code points ("B" < "_" < "a") and a linguistic collation.
CHATS = ("b", "B", "a", "_x", "Ä", "10", "9")


def test_store_mirror_is_todays_document(open_store: Opener) -> None:
    store = open_store(gateway=mirrored())
    for chat in CHATS:
        store.get_or_create_session(telegram_dm(chat, chat_name=f"Chat {chat} ✓"))
    store.close()
    routes = {entry["session_key"]: entry for entry in store._backing.backend.iter_routes()}
    assert len(routes) == len(CHATS)
    assert (store.sessions_dir / "sessions.json").read_bytes() == whole_document(routes)


def test_past_the_limit_the_mirror_is_removed_with_one_warning(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(gateway=mirrored(sessions_json_max_lanes=3))
    mirror = store.sessions_dir / "sessions.json"
    for chat in CHATS[:3]:
        store.get_or_create_session(telegram_dm(chat))
    assert store._fallback.flush_mirror(force=True)
    assert len(json.loads(mirror.read_bytes())) == 4
    store.get_or_create_session(telegram_dm(CHATS[3]))
    with caplog.at_level(logging.WARNING):
        assert not store._fallback.flush_mirror(force=True)
        store.get_or_create_session(telegram_dm(CHATS[4]))
        assert not store._fallback.flush_mirror(force=True)
        store.close()
    assert not mirror.exists()
    warnings = [r.getMessage() for r in caplog.records if "sessions_json_max_lanes" in r.message]
    assert len(warnings) == 1
    assert "more than gateway.sessions_json_max_lanes (3) lanes" in warnings[0]
    assert "removed the outdated" in warnings[0]
    again = open_store(gateway=mirrored(sessions_json_max_lanes=5))  # raised: written again
    again.close()
    assert len(json.loads(mirror.read_bytes())) == 6
