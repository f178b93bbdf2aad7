"""Durable-turn throughput of the SQLite store, beside raw ``sqlite3`` doing the same rows.

A turn through the public API: ``get_or_create_session`` (existing lane, touch),
``mark_turn_active``, two ``append_to_transcript`` (user, assistant), ``update_session`` and
``clear_turn_active``: six transactions, each committed before the call returns. The raw floor
runs the same statements with ``sqlite3`` on a database of the same schema (FTS triggers included)
with prebuilt parameters: the least any store must pay for those rows.

Run: ``python -m benchmarks.bench_store [--turns N] [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import psutil

from hermes_core import GatewayConfig, SessionEntry, SessionSource, SessionStore
from hermes_core.domain.keys import build_key_from_flags
from hermes_core.testing import fresh_plugin_manager

USER = {"role": "user", "content": "What is the weather like in Kuala Lumpur this afternoon?"}
ASSISTANT = {"role": "assistant", "content": "Warm and humid, 32 °C, with a storm around five."}


def _config(home: Path, synchronous: str) -> GatewayConfig:
    settings = {"storage": {"sqlite_synchronous": synchronous}}
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def _open(home: Path, synchronous: str = "normal") -> SessionStore:
    return SessionStore.open(_config(home, synchronous), plugins=fresh_plugin_manager(home))


def _source(index: int) -> SessionSource:
    return SessionSource(platform="telegram", chat_id=str(1_000_000 + index), user_name="bench")


def populated_session_id(index: int) -> str:
    """The session id :func:`populate` gives lane ``index``."""
    return f"20260101_000000_{index:08x}"


def lane_key(index: int) -> str:
    """The session key of lane ``index`` (the default key schema, as the stores here use)."""
    return build_key_from_flags(_source(index))


def populate(home: Path, sessions: int, history: int = 0, with_history: int = 0) -> None:
    """Create ``sessions`` lanes in bulk (raw inserts of rows the store would write); the first
    ``with_history`` lanes get ``history`` transcript messages each."""
    _open(home).close()  # schema
    now = datetime.now(timezone.utc)
    session_rows, route_rows, message_rows = [], [], []
    for index in range(sessions):
        source = _source(index)
        key = lane_key(index)
        session_id = populated_session_id(index)
        entry = SessionEntry(
            session_key=key, session_id=session_id, created_at=now, updated_at=now,
            origin=source, platform="telegram", chat_type="dm",
        )  # fmt: skip
        stamp = now.timestamp()
        session_rows.append((session_id, key, "telegram", source.chat_id, "dm", stamp, stamp,
                             json.dumps(source.to_dict())))  # fmt: skip
        route_rows.append((key, session_id, stamp, json.dumps(entry.to_dict())))
        if index < with_history:
            for n in range(history):
                message = USER if n % 2 == 0 else ASSISTANT
                message_rows.append((session_id, message["role"], message["content"], stamp))
    conn = sqlite3.connect(home / "state.db")
    conn.execute("PRAGMA journal_mode=WAL")
    with conn:
        conn.executemany(
            "INSERT INTO sessions (id, session_key, source, chat_id, chat_type, started_at, "
            "last_activity_at, origin_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            session_rows,
        )
        conn.executemany(
            "INSERT INTO gateway_routing (session_key, session_id, updated_at, suspended, "
            "resume_pending, revision, entry_json) VALUES (?, ?, ?, 0, 0, 1, ?)",
            route_rows,
        )
        conn.executemany(
            "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, ?, ?, ?)",
            message_rows,
        )
        conn.execute("INSERT OR REPLACE INTO state_meta VALUES ('sessions_json_imported', '1')")
    conn.close()


def store_rate(store: SessionStore, lanes: Sequence[int], turns: int) -> float:
    """Durable turns per second through the public API."""
    sources = [_source(index) for index in lanes]
    start = time.perf_counter()
    for turn in range(turns):
        entry = store.get_or_create_session(sources[turn % len(sources)])
        token = store.mark_turn_active(entry.session_key)
        assert token is not None
        store.append_to_transcript(entry.session_id, USER)
        store.append_to_transcript(entry.session_id, ASSISTANT)
        store.update_session(entry.session_key, input_tokens=120, output_tokens=40)
        store.clear_turn_active(entry.session_key, token)
    return turns / (time.perf_counter() - start)


def raw_rate(database: Path, lanes: Sequence[int], turns: int, synchronous: str) -> float:
    """The same six transactions and rows with ``sqlite3`` and prebuilt parameters."""
    conn = sqlite3.connect(database, isolation_level="IMMEDIATE")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    conn.execute("PRAGMA foreign_keys=ON")
    targets = []
    for index in lanes:
        key = lane_key(index)
        row = conn.execute(
            "SELECT session_id, entry_json FROM gateway_routing WHERE session_key = ?", (key,)
        ).fetchone()
        targets.append((key, row[0], row[1]))
    upsert = (
        "INSERT INTO gateway_routing (session_key, session_id, updated_at, suspended, "
        "resume_pending, active_turn_token, revision, entry_json) VALUES (?, ?, ?, 0, 0, ?, 1, ?) "
        "ON CONFLICT (session_key) DO UPDATE SET session_id = excluded.session_id, updated_at = "
        "excluded.updated_at, suspended = excluded.suspended, resume_pending = "
        "excluded.resume_pending, active_turn_token = excluded.active_turn_token, revision = "
        "gateway_routing.revision + 1, entry_json = excluded.entry_json"
    )
    insert = (
        "INSERT INTO messages (session_id, role, content, tool_calls, tool_call_id, tool_name, "
        "timestamp, token_count, finish_reason, platform_message_id, display_kind, extra_json) "
        "VALUES (?, ?, ?, NULL, NULL, NULL, ?, NULL, NULL, NULL, NULL, NULL)"
    )
    count = (
        "UPDATE sessions SET message_count = message_count + 1, last_activity_at = ? WHERE id = ?"
    )
    counters = (
        "UPDATE sessions SET input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, "
        "total_tokens = total_tokens + ?, last_activity_at = ? WHERE id = ?"
    )
    clear = (
        "UPDATE gateway_routing SET active_turn_token = NULL, entry_json = ?, revision = "
        "revision + 1 WHERE session_key = ? AND active_turn_token = ?"
    )
    start = time.perf_counter()
    for turn in range(turns):
        key, session_id, entry_json = targets[turn % len(targets)]
        now = time.time()
        conn.execute(upsert, (key, session_id, now, None, entry_json))
        conn.commit()
        conn.execute(upsert, (key, session_id, now, "t" * 32, entry_json))
        conn.commit()
        for message in (USER, ASSISTANT):
            conn.execute(insert, (session_id, message["role"], message["content"], now))
            conn.execute(count, (now, session_id))
            conn.commit()
        conn.execute(upsert, (key, session_id, now, "t" * 32, entry_json))
        conn.execute(counters, (120, 40, 160, now, session_id))
        conn.commit()
        conn.execute(clear, (entry_json, key, "t" * 32))
        conn.commit()
    rate = turns / (time.perf_counter() - start)
    conn.close()
    return rate


def measure(
    sessions: int, turns: int, lanes: int, synchronous: str, history: int = 0
) -> tuple[float, float]:
    """(store rate, raw rate) on a fresh store of ``sessions`` lanes; the turns cycle over
    ``lanes`` of them picked at random (each with ``history`` messages already stored)."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        populate(home, sessions, history=history, with_history=lanes if history else 0)
        chosen = random.Random(7).sample(range(sessions if not history else lanes), lanes)
        store = _open(home, synchronous)
        store_rate(store, chosen[:20], 100)  # warm-up: imports, statement caches
        rate = store_rate(store, chosen, turns)
        store.close()
        floor = raw_rate(home / "state.db", chosen, turns, synchronous)
    return rate, floor


def open_cost(sessions: int, touched: int) -> tuple[float, float, float]:
    """(seconds to open, KiB of RSS the open store adds, MiB after ``touched`` distinct lanes
    have been looked up) for a store of ``sessions`` lanes."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        populate(home, sessions)
        gc.collect()
        process = psutil.Process()
        before = process.memory_info().rss
        start = time.perf_counter()
        store = _open(home)
        seconds = time.perf_counter() - start
        opened = (process.memory_info().rss - before) / 2**10
        for index in range(min(touched, sessions)):
            store.lookup_by_session_key(lane_key(index))
        warm = (process.memory_info().rss - before) / 2**20
        store.close()
    return seconds, opened, warm


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=3000, help="turns per measurement")
    parser.add_argument("--quick", action="store_true", help="10,000 sessions instead of 100,000")
    args = parser.parse_args(argv)
    big = 10_000 if args.quick else 100_000
    turns = args.turns
    print("SQLite, WAL; six transactions per turn; raw floor = sqlite3, same rows and schema")
    print(f"{'measurement':44} {'store/s':>9} {'raw/s':>9} {'ratio':>6}")
    results: dict[str, float] = {}
    for synchronous in ("normal", "full"):
        rate, floor = measure(1_000, turns, 200, synchronous)
        results[synchronous] = rate
        label = f"1,000 sessions, synchronous={synchronous}"
        print(f"{label:44} {rate:9,.0f} {floor:9,.0f} {rate / floor:6.2f}")
    rate_big, floor_big = measure(big, turns, 200, "normal")
    print(f"{big:,} sessions".ljust(44)
          + f" {rate_big:9,.0f} {floor_big:9,.0f} {rate_big / floor_big:6.2f}")  # fmt: skip
    short, short_floor = measure(200, turns, 100, "normal", history=10)
    long, long_floor = measure(200, turns, 100, "normal", history=1_000)
    print(f"{'transcripts of 10 messages':44} {short:9,.0f} {short_floor:9,.0f} "
          f"{short / short_floor:6.2f}")  # fmt: skip
    print(f"{'transcripts of 1,000 messages':44} {long:9,.0f} {long_floor:9,.0f} "
          f"{long / long_floor:6.2f}")  # fmt: skip
    print(f"rate with {big:,} sessions / rate with 1,000: {rate_big / results['normal']:.2f}")
    print(f"rate at 1,000 messages / rate at 10: {long / short:.2f}")
    for sessions in (1_000, big):
        seconds, opened, warm = open_cost(sessions, touched=30_000)
        looked_up = min(30_000, sessions)
        print(f"store of {sessions:,} sessions: open {seconds * 1000:.0f} ms, "
              f"RSS +{opened:.0f} KiB; after looking up {looked_up:,} lanes +{warm:.1f} MiB "
              "(entry cache bounded at 10,000)")  # fmt: skip
    print("targets: >= 5,000 turns/s; >= 0.3 of raw; size and history ratios >= 0.8; open < 1 s")


if __name__ == "__main__":
    main()
