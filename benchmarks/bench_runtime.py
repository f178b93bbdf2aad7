"""Turns through the real ``hermes_core.gateway.runtime.Gateway``, beside a raw ``sqlite3`` floor.

Every figure drives ``Gateway.handle_message`` with ``EchoAgent`` (no delay) and counts a turn
when its reply reached the adapter (an adapter whose ``send`` resolves the chat's future); the
reply texts and their number are checked, a mismatch or a missing reply fails the run. A message
never goes to a lane whose turn may still be closing, so nothing waits in the busy queue.
Housekeeping never runs (first pass after 10^6 s), busy acknowledgements and the
``sessions.json`` mirror are off, third-party plugins are not loaded and the agent cache holds 256
(the default 128 is below the 200 turns in flight); the rest (delivery ledger, entry cache of
10,000, ...) is at its default. Commits, round trips, writer batches and writer steps per turn are
differences of ``gateway.store.stats()`` around a measurement divided by its turns. "cpu us" is the
process's CPU time per turn (``time.process_time``: every thread, the event loop's and the store
writer's) beside the wall time per turn: where the two are close, the process was computing all
along, on one core at a time (the interpreter lock), and only less CPU per turn makes it faster.

Each measurement is ``N`` turns (``--turns``, default 5,000), split into 3 rounds that alternate
with the measurements it is compared with, so that the ratios come from the same minutes; each
target line gives the ratio of the whole measurements and, in brackets, its lowest and highest
value over the rounds (how much the machine moved it within the run).

1. 200 lanes, after a warm-up turn on each. 200 in flight: waves of one message to every lane;
   each wave is timed until all its turns have closed (``gateway.idle()``): sent continuously,
   a lane's next message would arrive while its turn is still settling the sent reply and go
   through the durable busy queue. One at a time: each message awaited until its reply was sent,
   cycling over the same 200 lanes (the next message is always another lane's).
2. Raw floor (SQLite only), in the same rounds: ``sqlite3`` on its own file, WAL,
   ``synchronous=NORMAL``, one turn at a time over 200 lanes in three commits: (1) the user
   message and the lane's turn marker; (2) the reply, an owed-reply row, the marker cleared;
   (3) the owed-reply row settled (deleted); an external-content FTS5 table over the messages
   is kept by an insert trigger; the message texts are the gateway's.
3. First turn of a never-seen chat (its session is created) against the second turn of the same
   chat, one at a time, in alternating blocks of new lanes.
4. Scale (SQLite only), 200 in flight continuously (200 workers, each taking the next message
   once its previous reply was sent; a lane's next message is 1,000 messages later, long after
   its turn closed). Stores pre-created with ``bench_store.populate`` (raw inserts of the
   ``sessions`` and ``gateway_routing`` rows the store writes, plus one user message and one
   reply per lane, as if every lane had had a turn). On a store of 100,000 lanes, after a
   warm-up turn on 1,000 of them: ``N`` turns, one on each of ``N`` lanes drawn without
   repetition from the other 99,000 (every lane equally likely, none hot; each is cold in the
   store's entry cache of 10,000 and in the agent and prompt caches, as in a steady state where
   more lanes are active than the caches hold) against ``N`` turns cycling over the 1,000 warmed
   lanes of the same store, and over the 1,000 lanes of a second store of 1,000 lanes (the two
   gateways run side by side), and against turns on cold lanes of the store of 1,000 lanes (a
   gateway started afresh on it each round; see ``cold_lanes``); the four measurements
   alternate in rounds. Before each round over the 1,000 lanes of the large store an untimed
   turn on each of them caches them again (the cold turns before it pushed them out of the
   prompt cache), so that figure is the rate with 1,000 lanes active.

On PostgreSQL (``--url postgresql+psycopg://...``; its ``public`` schema is dropped and created
first) parts 1 and 3 run: the floor is SQLite's by definition and ``populate`` writes SQLite.

Run: ``python -m benchmarks.bench_runtime [--url URL] [--turns N] [--quick] [--wal-frames]``;
``--quick`` is a smoke run of 300 turns with 10,000 lanes in place of 100,000.

``--wal-frames`` (SQLite) prints, in place of the rest, the pages a turn writes: after a warm-up
turn on each of the 200 lanes the WAL is truncated and a second connection holds a read
transaction, so no checkpoint can copy or restart the WAL; after ``N`` turns (one at a time, then
200 in flight in waves) every frame header's page number is mapped to its b-tree through the
``dbstat`` table and the frames per turn are printed by b-tree.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sqlite3
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, make_url

from benchmarks.bench_store import _source, lane_key, populate, populated_session_id
from hermes_core import GatewayConfig, MessageEvent, SessionSource
from hermes_core.gateway.agents import EchoAgent
from hermes_core.gateway.runtime import Gateway
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.turns.ledger import SendResult

LANES = 200
IN_FLIGHT = 200
AGENT_CACHE = 256
"""Agents cached: above the turns in flight (at the default 128 every turn over it logs that the
cache is over its cap with only busy agents to release)."""
ROUNDS = 3
SCALE_SESSIONS = 100_000
SMALL_SESSIONS = 1_000
NEW_LANE_BASE = 5_000_000
"""Chat index of the first never-seen lane (``populate`` uses 0 up to its sessions)."""
COUNTERS = ("commits", "round_trips", "batches", "steps")
STALL_SECS = 30.0
"""A measurement fails when no reply was sent for this long."""


class DeliveryError(RuntimeError):
    """A reply was missing, unexpected or not the echo of its message."""


def _text(number: int) -> str:
    return f"question {number}: what is the weather like in Kuala Lumpur this afternoon?"


def _reply(text: str) -> str:
    return f"echo: {text}"


def _config(home: Path, url: str | None) -> GatewayConfig:
    storage: dict[str, object] = {"sqlite_synchronous": "normal"}
    if url is not None:
        storage["url"] = url
    settings = {
        "storage": storage,
        "gateway": {
            "housekeeping": {"initial_delay_secs": 1e6},
            "busy_ack_enabled": False,
            "write_sessions_json": False,
        },
        "agent": {"agent_cache": {"max_size": AGENT_CACHE}},
        "plugins": {"autoload": False},
    }
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def empty_postgres(url: str) -> None:
    """Drop and recreate the ``public`` schema (as the tests' ``empty_database`` fixture)."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA IF EXISTS public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()


class Deliveries:
    """An adapter that resolves the future of the reply's chat when a reply is sent."""

    platform = "telegram"

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future[str]] = {}
        self.sent = 0
        self.unexpected: list[str] = []

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        self.sent += 1
        future = self.waiting.pop(source.chat_id, None)
        if future is None:
            self.unexpected.append(f"chat {source.chat_id}: {text!r}")
        else:
            future.set_result(text)
        return SendResult(ok=True)


def thread_cpu(since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds so far of this process's threads, by thread name (the store's writer
    threads are ``hermes-store-writer``, the event loop's ``MainThread``); read from Linux's
    ``/proc``, empty where there is none; with ``since`` (an earlier reading), what they
    spent since."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    found: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task), "other")
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return {name: spent - (since or {}).get(name, 0.0) for name, spent in found.items()}


@dataclass
class Figure:
    """Turns, seconds, process CPU and store counters accumulated over the rounds of one
    measurement, with each round's turns and seconds (for the spread of a ratio over rounds)."""

    label: str
    turns: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    """Process CPU seconds (every thread: the event loop's and the writer's)."""
    counters: Counter[str] = field(default_factory=Counter)
    missing: set[str] = field(default_factory=set)
    rounds: list[tuple[int, float]] = field(default_factory=list)
    threads: dict[str, float] = field(default_factory=dict)
    """CPU seconds by thread name (:func:`thread_cpu`), over the same spans as ``cpu``."""

    @property
    def rate(self) -> float:
        return self.turns / self.seconds

    def add_round(self, turns: int, seconds: float, cpu: float) -> None:
        self.turns += turns
        self.seconds += seconds
        self.cpu += cpu
        self.rounds.append((turns, seconds))

    def add(
        self,
        turns: int,
        seconds: float,
        cpu: float,
        before: dict[str, int],
        after: dict[str, int],
        threads: dict[str, float] | None = None,
    ) -> None:
        self.add_round(turns, seconds, cpu)
        for name, spent in (threads or {}).items():
            self.threads[name] = self.threads.get(name, 0.0) + spent
        for name in COUNTERS:
            if name in before and name in after:
                self.counters[name] += after[name] - before[name]
            else:
                self.missing.add(name)

    def thread_us(self, name: str) -> float:
        """Microseconds of CPU per turn of the threads named ``name``, or ``name-N`` (the
        writer threads of a store with several)."""
        spent = sum(
            seconds
            for thread, seconds in self.threads.items()
            if thread == name or thread.rpartition("-")[0] == name
        )
        return 1e6 * spent / self.turns if self.turns else 0.0

    def per_turn(self, name: str) -> str:
        if name in self.missing or not self.turns:
            return "n/a"
        return f"{self.counters[name] / self.turns:.3f}"

    def row(self) -> str:
        figures = "".join(f" {self.per_turn(name):>7}" for name in COUNTERS)
        cpu = 1e6 * self.cpu / self.turns
        return f"{self.label:52} {self.rate:8,.0f} {1e6 / self.rate:8.0f} {cpu:8.0f}{figures}"


def ratio_spread(numerator: Figure, denominator: Figure) -> tuple[float, float]:
    """The lowest and highest ratio of the two figures' rates, round by round (the rounds of
    the two alternate, so round ``i`` of each comes from the same minutes)."""
    ratios = [
        (turns / seconds) / (other_turns / other_seconds)
        for (turns, seconds), (other_turns, other_seconds) in zip(
            numerator.rounds, denominator.rounds, strict=True
        )
    ]
    return min(ratios), max(ratios)


class Run:
    """One started gateway with its adapter and a message numbering."""

    def __init__(self, home: Path, url: str | None, numbers: Iterator[int] | None = None) -> None:
        """``numbers``: the message numbering to go on with (a message id used on the store
        before would be taken for a redelivery); None: from 0."""
        config = _config(home, url)
        self.adapter = Deliveries()
        self.gateway = Gateway(
            config,
            create_plugin_manager(config, load_entrypoints=False, strict=True),
            lambda entry: EchoAgent(),
            [self.adapter],
        )
        self.numbers = numbers if numbers is not None else iter(range(10**9))
        self._sources: dict[int, SessionSource] = {}

    def events(self, lanes: Sequence[int], turns: int) -> list[MessageEvent]:
        """``turns`` messages cycling over ``lanes`` (chat indexes), in that order."""
        events = []
        for turn in range(turns):
            index = lanes[turn % len(lanes)]
            source = self._sources.get(index)
            if source is None:
                source = self._sources[index] = _source(index)
            number = next(self.numbers)
            events.append(MessageEvent(source=source, text=_text(number), message_id=f"m{number}"))
        return events

    async def deliver(self, events: Sequence[MessageEvent], in_flight: int) -> None:
        """Send ``events`` and wait until their replies were sent, with at most ``in_flight``
        turns running and never two of one chat."""
        pending = iter(events)
        waiting = self.adapter.waiting
        loop = asyncio.get_running_loop()

        async def worker() -> None:
            for event in pending:
                chat = event.source.chat_id
                while (previous := waiting.get(chat)) is not None:
                    await previous
                reply = waiting[chat] = loop.create_future()
                await self.gateway.handle_message(event)
                text = await reply
                if text != _reply(event.text):
                    raise DeliveryError(f"chat {chat}: expected {_reply(event.text)!r}: {text!r}")

        done = asyncio.gather(*(worker() for _ in range(min(in_flight, len(events)))))
        sent = -1
        while not (await asyncio.wait({done}, timeout=STALL_SECS))[0]:
            if self.adapter.sent == sent:
                done.cancel()
                raise DeliveryError(
                    f"no reply sent for {STALL_SECS:g} s ({len(waiting)} awaited): a turn "
                    "failed inside the gateway or a reply was never sent"
                )
            sent = self.adapter.sent
        done.result()

    async def measure(
        self,
        figure: Figure | None,
        events: Sequence[MessageEvent],
        in_flight: int,
        *,
        waves: bool = False,
    ) -> None:
        """Run ``events``, check their replies and add the time and the store counters to
        ``figure`` (None: a warm-up). Continuous: the clock stops at the last reply. In waves
        of ``in_flight`` messages: each wave's turns must all have closed (``idle``) before the
        next wave starts, and the clock runs until the last one closed."""
        store = self.gateway.store
        sent = self.adapter.sent
        before = store.stats()
        threads = thread_cpu()
        cpu = time.process_time()
        start = time.perf_counter()
        if waves:
            for first in range(0, len(events), in_flight):
                await self.deliver(events[first : first + in_flight], in_flight)
                await self.gateway.idle()
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
            threads = thread_cpu(threads)
        else:
            await self.deliver(events, in_flight)
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
            threads = thread_cpu(threads)
            await self.gateway.idle()
        after = store.stats()
        replies = self.adapter.sent - sent
        if replies != len(events) or self.adapter.unexpected:
            raise DeliveryError(
                f"{len(events)} messages, {replies} replies sent; unexpected sends: "
                f"{self.adapter.unexpected[:5]}"
            )
        if figure is not None:
            figure.add(len(events), seconds, cpu, before, after, threads)


class Floor:
    """Raw ``sqlite3``: the lean rows of a turn in three commits, one turn at a time."""

    SCHEMA = (
        "CREATE TABLE routing (session_key TEXT PRIMARY KEY, session_id TEXT NOT NULL, "
        "active_turn_token TEXT, updated_at REAL)",
        "CREATE TABLE messages (id INTEGER PRIMARY KEY, session_id TEXT NOT NULL, role TEXT NOT "
        "NULL, content TEXT, timestamp REAL NOT NULL, platform_message_id TEXT)",
        "CREATE INDEX ix_messages_session ON messages (session_id, id)",
        "CREATE TABLE owed (obligation_id TEXT PRIMARY KEY, session_key TEXT NOT NULL, "
        "chat_id TEXT, content TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL)",
        "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', "
        "content_rowid='id')",
        "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN INSERT INTO "
        "messages_fts(rowid, content) VALUES (new.id, new.content); END",
    )

    def __init__(self, path: Path, lanes: int = LANES) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        for statement in self.SCHEMA:
            self.conn.execute(statement)
        self.lanes = [
            (f"agent:main:telegram:dm:{1_000_000 + i}", f"s{i:08x}", str(1_000_000 + i))
            for i in range(lanes)
        ]
        self.conn.executemany(
            "INSERT INTO routing (session_key, session_id) VALUES (?, ?)",
            [(key, session_id) for key, session_id, _chat in self.lanes],
        )
        self._numbers = iter(range(10**9))

    def run(self, turns: int) -> tuple[float, float]:
        """Seconds and process CPU seconds for ``turns`` turns cycling over the lanes (texts
        built beforehand)."""
        conn = self.conn
        work = []
        for turn in range(turns):
            number = next(self._numbers)
            text = _text(number)
            work.append((*self.lanes[turn % len(self.lanes)], text, _reply(text), number))
        cpu = time.process_time()
        start = time.perf_counter()
        for key, session_id, chat_id, text, reply, number in work:
            now = time.time()
            token = f"{number:032x}"
            conn.execute("BEGIN")
            conn.execute(
                "INSERT INTO messages (session_id, role, content, timestamp, platform_message_id)"
                " VALUES (?, 'user', ?, ?, ?)",
                (session_id, text, now, f"m{number}"),
            )
            conn.execute(
                "UPDATE routing SET active_turn_token = ?, updated_at = ? WHERE session_key = ?",
                (token, now, key),
            )
            conn.execute("COMMIT")
            conn.execute("BEGIN")
            conn.execute(
                "INSERT INTO messages (session_id, role, content, timestamp) "
                "VALUES (?, 'assistant', ?, ?)",
                (session_id, reply, now),
            )
            conn.execute(
                "INSERT INTO owed (obligation_id, session_key, chat_id, content, state, "
                "created_at) VALUES (?, ?, ?, ?, 'pending', ?)",
                (token, key, chat_id, reply, now),
            )
            conn.execute(
                "UPDATE routing SET active_turn_token = NULL, updated_at = ? "
                "WHERE session_key = ? AND active_turn_token = ?",
                (now, key, token),
            )
            conn.execute("COMMIT")
            conn.execute("BEGIN")
            conn.execute("DELETE FROM owed WHERE obligation_id = ?", (token,))
            conn.execute("COMMIT")
        return time.perf_counter() - start, time.process_time() - cpu

    def close(self) -> None:
        self.conn.close()


def _rounds(turns: int) -> Iterator[int]:
    """``turns`` split into ``ROUNDS`` chunks."""
    for index in range(ROUNDS):
        yield turns // ROUNDS + (1 if index < turns % ROUNDS else 0)


async def lanes_and_floor(run: Run, turns: int, floor: Floor | None) -> tuple[Figure, ...]:
    """Part 1 and 2: 200 lanes with 200 in flight and one at a time, beside the raw floor."""
    lanes = range(LANES)
    await run.measure(None, run.events(lanes, LANES), IN_FLIGHT, waves=True)  # the lanes
    await run.measure(None, run.events(lanes, LANES), 1)
    if floor is not None:
        floor.run(LANES)
    busy = Figure(f"{LANES} lanes, {IN_FLIGHT} in flight (waves)")
    serial = Figure(f"{LANES} lanes, one at a time")
    raw = Figure(f"raw floor: sqlite3, {LANES} lanes, one at a time")
    for chunk in _rounds(turns):
        await run.measure(busy, run.events(lanes, chunk), IN_FLIGHT, waves=True)
        await run.measure(serial, run.events(lanes, chunk), 1)
        if floor is not None:
            raw.add_round(chunk, *floor.run(chunk))
            raw.counters["commits"] += 3 * chunk
            raw.missing.update({"round_trips", "batches", "steps"})
    return (busy, serial, raw) if floor is not None else (busy, serial)


async def first_and_later(run: Run, turns: int) -> tuple[Figure, Figure]:
    """Part 3: first turns of never-seen chats against second turns of the same chats."""
    first = Figure("first turn of a new lane, one at a time")
    later = Figure("second turn of that lane, one at a time")
    base = NEW_LANE_BASE
    for chunk in _rounds(turns):
        lanes = range(base, base + chunk)
        base += chunk
        await run.measure(first, run.events(lanes, chunk), 1)
        await run.measure(later, run.events(lanes, chunk), 1)
    return first, later


async def scale(big_home: Path, small_home: Path, turns: int, big: int) -> tuple[Figure, ...]:
    """Part 4: ``turns`` turns on as many lanes drawn from ``big`` against ``turns`` turns over
    1,000 lanes of the same store and of a store of 1,000 lanes."""
    populate(big_home, big, history=2, with_history=big)
    populate(small_home, SMALL_SESSIONS, history=2, with_history=SMALL_SESSIONS)
    return await cold_lanes(big_home, small_home, turns, big)


FRESH_WARMUP = (IN_FLIGHT, 1_000)
"""Lanes of the 1,000-lane store, and turns over them, that a gateway just started on it serves
untimed before its cold turns are timed: what a gateway builds once, in its first thousand
turns, is then built, as it is in the large store's gateway, serving since long before (after
200 turns instead, the small store's cold turns ran 15 % slower than those of a store of
10,000 lanes)."""


async def cold_lanes(
    big_home: Path,
    small_home: Path,
    turns: int,
    big: int,
    urls: tuple[str | None, str | None] = (None, None),
) -> tuple[Figure, ...]:
    """The measurements of :func:`scale` on stores filled already, whose lanes are those of
    ``bench_store.populate`` (lane ``i`` keyed by ``lane_key(i)``, on session
    ``populated_session_id(i)``); ``urls``: the two stores' URLs (None: SQLite in the home).

    Four figures, their rounds alternating: cold lanes of the large store (each turn a lane
    not served since its gateway started), 1,000 warm lanes of it, the 1,000 warm lanes of the
    1,000-lane store, and cold lanes of the 1,000-lane store (each round on a gateway started
    afresh on it, after the untimed turns of :data:`FRESH_WARMUP` on other lanes; at most 800
    turns). The first against the last compares like with like, the store's size the only
    difference; against the warm ones it adds what a lane's first turn costs whatever the
    size."""
    draw = random.Random(7).sample(range(big), big)
    warm, sample = draw[:SMALL_SESSIONS], draw[SMALL_SESSIONS:]
    if turns > len(sample):
        raise SystemExit(f"--turns {turns} exceeds the {len(sample):,} lanes to draw from")
    random.Random(8).shuffle(small := list(range(SMALL_SESSIONS)))
    many = Figure(f"{big:,} lanes: each turn a lane of all {big:,}")
    same = Figure(f"{big:,} lanes: turns over 1,000 of them")
    few = Figure("1,000 lanes: turns over all 1,000")
    fresh = Figure("1,000 lanes: each turn a lane not yet served")
    runs = [Run(big_home, urls[0]), Run(small_home, urls[1])]
    for run in runs:
        await run.gateway.start()
    try:
        await runs[0].measure(None, runs[0].events(warm, len(warm)), IN_FLIGHT)
        await runs[1].measure(None, runs[1].events(small, len(small)), IN_FLIGHT)
        for index in (*warm[:3], *sample[:3]):  # turns go to the populated lanes, no new ones
            session_id = runs[0].gateway.store.peek_session_id(lane_key(index))
            if session_id != populated_session_id(index):
                raise DeliveryError(f"lane {index} is not the populated one: {session_id}")
        taken = 0
        for chunk in _rounds(turns):
            await runs[0].measure(
                many, runs[0].events(sample[taken : taken + chunk], chunk), IN_FLIGHT
            )
            taken += chunk
            # The cold turns just run pushed the 1,000 lanes out of the prompt cache (1,024):
            # one untimed pass brings them back, so the figure is that of 1,000 active lanes.
            await runs[0].measure(None, runs[0].events(warm, len(warm)), IN_FLIGHT)
            await runs[0].measure(same, runs[0].events(warm, chunk), IN_FLIGHT)
            await runs[1].measure(few, runs[1].events(small, chunk), IN_FLIGHT)
            runs[1] = await _restarted(runs[1], small_home, urls[1])
            random.Random(taken).shuffle(order := list(small))
            warmup, cold = order[: FRESH_WARMUP[0]], order[FRESH_WARMUP[0] :][:chunk]
            await runs[1].measure(None, runs[1].events(warmup, FRESH_WARMUP[1]), IN_FLIGHT)
            await runs[1].measure(fresh, runs[1].events(cold, len(cold)), IN_FLIGHT)
            runs[1] = await _restarted(runs[1], small_home, urls[1])
            await runs[1].measure(None, runs[1].events(small, len(small)), IN_FLIGHT)
    finally:
        for run in runs:
            await run.gateway.stop()
    return many, same, few, fresh


async def _restarted(run: Run, home: Path, url: str | None) -> Run:
    """``run``'s gateway stopped and a new one started on the same store, numbering its
    messages on from ``run``'s (a message id used before would be taken for a redelivery)."""
    await run.gateway.stop()
    again = Run(home, url, run.numbers)
    await again.gateway.start()
    return again


WAL_HEADER = 32
FRAME_HEADER = 24


def _wal_pages(wal: Path) -> list[int]:
    """The page number of every frame in the WAL file ``wal``."""
    data = wal.read_bytes()
    if len(data) < WAL_HEADER:
        return []
    frame = FRAME_HEADER + struct.unpack(">I", data[8:12])[0]
    return [
        struct.unpack(">I", data[offset : offset + 4])[0]
        for offset in range(WAL_HEADER, len(data) - frame + 1, frame)
    ]


async def wal_frames(run: Run, database: Path, turns: int) -> None:
    """Frames written to the WAL per turn, by b-tree, one at a time and 200 in flight."""
    lanes = range(LANES)
    await run.measure(None, run.events(lanes, LANES), IN_FLIGHT, waves=True)
    with closing(sqlite3.connect(database, isolation_level=None, timeout=30)) as pin:
        for label, in_flight in (("one at a time", 1), (f"{IN_FLIGHT} in flight", IN_FLIGHT)):
            await run.gateway.idle()
            pin.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            pin.execute("BEGIN")
            pin.execute("SELECT count(*) FROM sqlite_schema").fetchone()  # holds the snapshot
            await run.measure(None, run.events(lanes, turns), in_flight, waves=in_flight > 1)
            await run.gateway.idle()
            pin.execute("COMMIT")
            owner = dict(pin.execute("SELECT pageno, name FROM dbstat").fetchall())
            counts = Counter(
                owner.get(page, "(free)") for page in _wal_pages(Path(f"{database}-wal"))
            )
            total = sum(counts.values())
            print(f"WAL frames per turn, {LANES} lanes, {label}: {total / turns:.2f}")
            for name, count in counts.most_common():
                print(f"  {count / turns:6.2f}  {name}")


def _target(
    label: str, value: float, target: float, at_most: bool = False, spread: str = ""
) -> str:
    met = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    verdict = "met" if met else "MISSED"
    return f"{label:52} {value:8.2f}   target {sign} {target:<4g} {verdict:6} {spread}".rstrip()


def _ratio(label: str, numerator: Figure, denominator: Figure, target: float) -> str:
    """The target line of a ratio of two figures' rates, with its range over the rounds."""
    low, high = ratio_spread(numerator, denominator)
    spread = f"(rounds {low:.2f}-{high:.2f})"
    return _target(label, numerator.rate / denominator.rate, target, spread=spread)


async def run_all(url: str | None, turns: int, scale_sessions: int, frames: bool) -> None:
    """Run every part, then print the figures and the targets (or only the WAL frames)."""
    postgres = url is not None and url.startswith("postgresql")
    if frames:
        with tempfile.TemporaryDirectory() as directory:
            run = Run(Path(directory), None)
            await run.gateway.start()
            try:
                await wal_frames(run, Path(directory) / "state.db", turns)
            finally:
                await run.gateway.stop()
        return
    where = "SQLite (WAL, synchronous=normal)"
    with ExitStack() as stack:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if url is not None and postgres:
            empty_postgres(url)
            where = f"PostgreSQL ({make_url(url).render_as_string(hide_password=True)})"
        run = Run(home / "gateway", url)
        floor = None if postgres else stack.enter_context(closing(Floor(home / "floor.db")))
        await run.gateway.start()
        backend = run.gateway.store.health()["backend"]
        try:
            parts = await lanes_and_floor(run, turns, floor)
            first, later = await first_and_later(run, turns)
        finally:
            await run.gateway.stop()
        scaled: tuple[Figure, ...] = ()
        if not postgres:
            scaled = await scale(home / "big", home / "small", turns, scale_sessions)
    print(f"hermes_core.gateway.runtime.Gateway + EchoAgent, {where}, store backend {backend!r}; "
          f"{turns:,} turns per measurement in {ROUNDS} alternating rounds")  # fmt: skip
    print(f"{'measurement':52} {'turns/s':>8} {'us/turn':>8} {'cpu us':>8}"
          + "".join(f" {name:>7}" for name in ("commits", "rtrips", "batches", "steps"))
          + "  (per turn)")  # fmt: skip
    gateway_figures = (*parts[:2], first, later, *scaled)
    for figure in (*parts, first, later, *scaled):
        print(figure.row())
    missing = sorted({name for figure in gateway_figures for name in figure.missing})
    if missing:
        print(f"store.stats() lacks: {', '.join(missing)}")
    busy, serial = parts[0], parts[1]
    print()
    if postgres:
        print(_ratio("200 in flight / one at a time", busy, serial, 3))
        for mode, figure in (("200 in flight", busy), ("one at a time", serial)):
            trips = figure.counters["round_trips"] / figure.turns
            print(_target(f"round trips per turn, {mode}", trips, 8, at_most=True))
        print(_ratio("first turn / later turn", first, later, 0.7))
        print("raw floor and scale: SQLite only, not run")
        return
    raw, (many, same, few, fresh) = parts[2], scaled
    print(_ratio("200 in flight / raw floor", busy, raw, 1.0))
    print(_ratio("one at a time / raw floor", serial, raw, 0.4))
    print(_ratio("first turn / later turn", first, later, 0.7))
    lanes = f"{scale_sessions:,} lanes / 1,000 lanes"
    print(_ratio(f"cold lanes, {lanes} of a store of 1,000, cold", many, fresh, 0.8))
    print(_ratio(f"cold lanes, {lanes} of a store of 1,000, warm", many, few, 0.8))
    print(_ratio(f"cold lanes, {lanes}, same store, warm", many, same, 0.8))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="storage URL (default: SQLite in a temporary HERMES_HOME)")
    parser.add_argument(
        "--turns", type=int, help="turns per measurement (default 5,000; quick 300)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 300 turns, 10,000 lanes for the scale"
    )
    parser.add_argument(
        "--wal-frames", action="store_true", help="only the WAL frames a turn writes, by b-tree"
    )
    args = parser.parse_args(argv)
    if args.wal_frames and args.url is not None:
        parser.error("--wal-frames measures SQLite: drop --url")
    turns = args.turns or (300 if args.quick else 5_000)
    if turns < ROUNDS:
        parser.error(f"--turns must be at least {ROUNDS}")
    started = time.perf_counter()
    asyncio.run(run_all(args.url, turns, 10_000 if args.quick else SCALE_SESSIONS, args.wal_frames))
    print(f"whole run: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
