"""``ls`` reads its lanes a page at a time, ordered, filtered and limited in the database: its
output is the one the full listing sorted in memory gave, on both backends, with more lanes than
a page, ties in every sort and every filter."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.dialects.sqlite import dialect as sqlite_dialect
from support.populate import config_for, populate, run, where

from hermes_core.cli import browse
from hermes_core.domain.models import SessionSource
from hermes_core.store import SessionStore
from hermes_core.store.operator import LaneFilter
from hermes_plugins.sql_store.lanes import lane_query

LANES = 11
"""Lanes added to the three of ``populate``: several pages of :data:`PAGE`."""
PAGE = 3


def _store(home: Path, url: str | None) -> None:
    """Fourteen lanes whose activity, creation and message counts tie in groups, two of them
    idle since 2000 (outside ``--active``)."""
    populate(home, url)
    base = datetime(2026, 12, 1, tzinfo=timezone.utc)
    with SessionStore.open(config_for(home, url)) as store:
        for number in range(LANES):
            source = SessionSource(platform="telegram", chat_id=str(2000 + number), user_id="5")
            entry = store.get_or_create_session(source)
            for _ in range(number % 4):
                store.append_to_transcript(entry.session_id, {"role": "user", "content": "hi"})
        for index, entry in enumerate(sorted(store.list_sessions(), key=lambda e: e.session_key)):
            updated = base + timedelta(minutes=index % 3)
            if index in (4, 9):
                updated = updated.replace(year=2000)
            store._backing.backend.put_route(  # direct writes: the only way to set these times
                entry.model_copy(
                    update={"updated_at": updated, "created_at": base - timedelta(days=index % 2)}
                ).to_dict()
            )


def _expected(home: Path, url: str | None, options: dict[str, Any]) -> list[dict[str, Any]]:
    """What ``ls --json`` printed before it paged: every entry listed, filtered, each lane's
    session row read, then a stable sort over the activity-ordered list."""
    with SessionStore.open(config_for(home, url), read_only=True) as store:
        dead = Counter(letter.session_key for letter in store.dead_letters())
        lanes = []
        for entry in store.list_sessions(options.get("active")):
            if (
                options.get("platform") in (None, entry.platform)
                and (not options.get("suspended") or entry.suspended)
                and (not options.get("dead_lettered") or dead[entry.session_key])
            ):
                row = store.session_row(entry.session_id)
                count = row.message_count if row is not None else 0
                lanes.append(browse.lane_summary(entry, count, dead))
    key, reverse = {
        "updated": (lambda lane: lane["updated_at"], True),
        "created": (lambda lane: lane["created_at"], True),
        "key": (lambda lane: lane["session_key"], False),
        "messages": (lambda lane: lane["message_count"], True),
    }[options.get("sort", "updated")]
    return sorted(lanes, key=key, reverse=reverse)[: options.get("limit")]


CASES: list[dict[str, Any]] = [
    {},
    {"limit": 5},
    {"limit": 1},
    {"sort": "created"},
    {"sort": "created", "limit": 7},
    {"sort": "key", "limit": 4},
    {"sort": "messages"},
    {"sort": "messages", "limit": 6},
    {"platform": "telegram", "limit": 4},
    {"platform": "telegram", "sort": "messages"},
    {"suspended": True},
    {"dead_lettered": True, "sort": "created"},
    {"active": 60 * 24 * 365, "sort": "key"},
    {"active": 60 * 24 * 365, "limit": 8},
]


def _argv(options: dict[str, Any]) -> list[str]:
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def test_ls_pages_print_what_the_full_listing_printed(
    tmp_path: Path, url: str | None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    home = tmp_path / "state"
    _store(home, url)
    monkeypatch.setattr(browse, "LS_PAGE", PAGE)
    for options in CASES:
        active = options.get("active")
        expected = _expected(home, url, options)
        if active is None:
            assert len(expected) == min(options.get("limit", 99), len(expected))
        code, out, err = run(capsys, "ls", *where(home, url), "--json", *_argv(options))
        assert (code, err) == (0, "")
        assert json.loads(out) == expected, options
    assert len(_expected(home, url, {})) == 3 + LANES
    assert len(_expected(home, url, {"active": 60 * 24 * 365})) == 3 + LANES - 2
    code, out, _ = run(capsys, "ls", *where(home, url), "--limit", "5")
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert listed == [lane["session_key"] for lane in _expected(home, url, {"limit": 5})]


def test_the_first_page_by_activity_is_read_through_its_index(tmp_path: Path) -> None:
    home = tmp_path / "state"
    populate(home)
    query = lane_query("sqlite", LaneFilter(), None, 20)
    statement = str(query.compile(dialect=sqlite_dialect(), compile_kwargs={"literal_binds": True}))
    with sqlite3.connect(home / "state.db") as conn:
        plan = " ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}"))
    assert "USING INDEX ix_gateway_routing_updated" in plan
    assert "TEMP B-TREE" not in plan  # no sort: the index gives the order
