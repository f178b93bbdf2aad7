"""How every cost grows with the store: stores of 10,000, 100,000 and N lanes (default 1,000,000
with M = 5,000,000 messages) built through the bulk import, then measured side by side.

Each store is built with ``hermes_core.store.bulk.import_lanes`` (the path of ``hermes-sessions
import-gateway``) from generated lanes: lane ``i`` is ``bench_store``'s (its key
``lane_key(i)``, its session ``populated_session_id(i)``, a Telegram DM), last active at a time
spread over the past 400 days; the messages, ``M * lanes / N`` of them, are dealt out Zipf-like
(lane of rank ``r`` gets a share ``r ** -0.7``, at most 5,000, ranks shuffled over the lanes):
most lanes hold one to three messages, a few hold thousands. Texts are sentences of a fixed
vocabulary; a third of the messages hold the common term ``weather``, one in 20,000 one of 50
rare terms ``quokkaK``.

For each store (and beside it a store of 1,000 lanes built the same way):

- build: the import's wall time, lanes/s and messages/s; size on disk (the SQLite files; on
  PostgreSQL ``pg_database_size``);
- open: ``SessionStore.open`` in a fresh child process, its wall time and the RSS it added,
  twice: the first open of an imported store records the key schema its lanes follow (the
  import does not), the second is every later open;
- cold turn: ``bench_runtime.cold_lanes`` (turns through the real gateway, 200 in flight, each on
  a lane the gateway has not served since it started, drawn from all of them, against turns on
  the same kind of lane of the store of 1,000 lanes, each round on a gateway started afresh on
  it, in alternating rounds): the ratio of the rates, the target's; beside it the ratio to
  turns over the 1,000 lanes of that store once each has been served (warm: its entry, agent
  and prompt in memory, which a cold lane's first turn builds whatever the store's size), and
  the CPU per turn of the store's writer threads and of the event loop's (Linux: from
  ``/proc``), beside the small store's cold turn's;
- gateway start: a gateway started on the store after those turns' clean stop, twice (what
  start-up reads: the lanes with a turn marker or marked to resume, the ledger's owed rows);
- search: p50 and p95 of ``store.search`` (limit 20) over 20 queries of a rare term and 20 of
  the common term (each query once after one untimed warm-up);
- the operator commands, each a real ``hermes-sessions`` child process, wall time and peak RSS
  (sampled, summed over the command and the worker processes ``export`` starts): ``ls --limit
  20``, ``show`` of a random lane, ``export --output /dev/null`` (messages/s), ``doctor --json``,
  ``migrate --to`` an empty store (SQLite: a file; PostgreSQL: the database ``<name>_copy``),
  ``rekey --forum telegram 1`` (walks every lane, moves none) and last ``prune --days 365``
  (removes the routing entries of about a tenth of the lanes).
  A command that runs past ``--command-timeout`` (default 900 s) or ``--command-rss-cap``
  (default 6,144 MiB) is killed and shown as ``>T / >RSS``, what it reached by then.

PostgreSQL (``--url postgresql+psycopg://.../NAME``): the stores go to NAME (its ``public`` schema
dropped and created for each size), the store of 1,000 lanes to ``NAME_small`` and the migration to
``NAME_copy`` (created when missing). Run one size at a time on a shared machine: each is built,
measured and dropped before the next.

Run: ``python -m benchmarks.bench_scale [--url URL] [--lanes N] [--messages M] [--turns T]
[--quick]``; ``--quick``: N = 20,000 lanes, M = 100,000 messages, 300 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
from sqlalchemy import create_engine, make_url

from benchmarks.bench_runtime import SMALL_SESSIONS, Run, _config, cold_lanes, empty_postgres
from benchmarks.bench_store import _source, lane_key, populated_session_id
from hermes_core.cli.common import open_operator
from hermes_core.domain.models import SessionEntry
from hermes_core.domain.timeutil import format_utc
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store import SessionStore
from hermes_core.store.bulk import ImportedLane, import_lanes
from hermes_core.store.replay import session_row_from_entry

SIZES = (10_000, 100_000)
"""The store sizes measured below N."""
ZIPF = 0.7
LONGEST = 5_000
"""The most messages a generated lane holds."""
COMMON = "weather"
RARE = tuple(f"quokka{k}" for k in range(50))
RARE_EVERY = 20_000
SENTENCE_WORDS = (
    "the a to of and in is it you that for on with be this are was can not have what do at "
    "about time will your how if one all but there so my me we know like just get would make "
    "when could well back think some more only way see then than into also after good first "
    "new work because any these give day most us place plan train ticket price meeting list "
    "email note draft reply summary project budget report question answer code error file"
)
WORDS = tuple(SENTENCE_WORDS.split())
BATCH = 2_000
"""Lanes per import transaction."""


# -- the stores -----------------------------------------------------------------------------------


def lane_lengths(lanes: int, messages: int, seed: int = 11) -> list[int]:
    """Messages per lane: Zipf-like shares of ``messages`` (at most :data:`LONGEST`), over ranks
    shuffled across the lanes, summing to ``messages`` exactly."""
    weights = [(rank + 1) ** -ZIPF for rank in range(lanes)]
    scale = messages / sum(weights)
    lengths = [min(LONGEST, int(weight * scale)) for weight in weights]
    short, rank = messages - sum(lengths), lanes - 1
    while short > 0:  # the remainder goes one by one to the shortest lanes
        lengths[rank] += 1
        short -= 1
        rank = rank - 1 if rank else lanes - 1
    random.Random(seed).shuffle(lengths)
    return lengths


def message_text(number: int) -> str:
    """A sentence of 12 to 40 words; the common and rare terms as the module says."""
    draw = random.Random(number)
    words = draw.choices(WORDS, k=12 + number % 29)
    if number % 3 == 0:
        words[draw.randrange(len(words))] = COMMON
    if number % RARE_EVERY == 7:
        words[0] = RARE[(number // RARE_EVERY) % len(RARE)]
    return " ".join(words)


def generated_lanes(lengths: Sequence[int], now: datetime) -> Iterator[ImportedLane]:
    """Lane ``i`` as ``bench_store`` keys it, with ``lengths[i]`` messages."""
    source = _source(0)
    template = SessionEntry(
        session_key=lane_key(0), session_id=populated_session_id(0), created_at=now,
        updated_at=now, origin=source, platform="telegram", chat_type="dm",
    )  # fmt: skip
    entry, row = template.to_dict(), session_row_from_entry(template)
    origin = source.to_dict()
    number = 0
    for index, length in enumerate(lengths):
        updated = now - timedelta(seconds=(index * 7919) % (400 * 86_400))
        stamp = updated.timestamp()
        lane_origin = {**origin, "chat_id": _source(index).chat_id}
        session_id = populated_session_id(index)
        lane_entry = {**entry, "session_key": lane_key(index), "session_id": session_id,
                      "created_at": format_utc(updated - timedelta(days=1)),
                      "updated_at": format_utc(updated), "origin": lane_origin}  # fmt: skip
        lane_row = replace(row, id=session_id, session_key=lane_entry["session_key"],
                           chat_id=lane_origin["chat_id"], started_at=stamp - 3600,
                           last_activity_at=stamp, origin_json=json.dumps(lane_origin))  # fmt: skip
        messages = []
        for n in range(length):
            role = "user" if n % 2 == 0 else "assistant"
            text = message_text(number)
            messages.append({"role": role, "content": text, "timestamp": stamp - length + n})
            number += 1
        yield ImportedLane(lane_entry, lane_row, messages)


@dataclass
class Store:
    """One store of the run: where it is and how it was built."""

    lanes: int
    messages: int
    home: Path
    url: str | None
    build_secs: float = 0.0
    figures: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> list[str]:
        """The command-line options naming the store."""
        return ["--state-dir", str(self.home), *(["--url", self.url] if self.url else [])]


def build(store: Store) -> None:
    """Empty the store's database and fill it through the bulk import."""
    store.home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if store.url is not None:
        empty_postgres(store.url)
    config = _config(store.home, store.url)
    plugins = create_plugin_manager(config)
    target = open_operator(config, write=True, plugins=plugins)
    lengths = lane_lengths(store.lanes, store.messages)
    started = time.perf_counter()
    try:
        lanes = generated_lanes(lengths, datetime.now(timezone.utc))
        import_lanes(target, lanes, config=config, plugins=plugins, batch=BATCH)
    finally:
        target.close()
    store.build_secs = time.perf_counter() - started


def size_on_disk(store: Store) -> int:
    """Bytes: the SQLite files, or the PostgreSQL database."""
    if store.url is None:
        return sum(path.stat().st_size for path in store.home.glob("state.db*"))
    engine = create_engine(store.url)
    with engine.connect() as conn:
        size = conn.exec_driver_sql("SELECT pg_database_size(current_database())").scalar_one()
    engine.dispose()
    return int(size)


def sibling_database(url: str, suffix: str) -> str:
    """The URL of database ``<name><suffix>`` on the same server, created when missing."""
    parsed = make_url(url)
    name = f"{parsed.database}{suffix}"
    engine = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        exists = conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if exists.first() is None:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    engine.dispose()
    return parsed.set(database=name).render_as_string(hide_password=False)


# -- the measurements -----------------------------------------------------------------------------

OPEN_PROBE = """
import json, sys, time, psutil
from benchmarks.bench_runtime import _config
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store import SessionStore
config = _config(__import__("pathlib").Path(sys.argv[1]), sys.argv[2] or None)
plugins = create_plugin_manager(config, load_entrypoints=False)
before = psutil.Process().memory_info().rss
started = time.perf_counter()
store = SessionStore.open(config, plugins=plugins)
seconds = time.perf_counter() - started
print(json.dumps({"secs": seconds, "rss": psutil.Process().memory_info().rss - before}))
store.close()
"""


def hermes_sessions() -> list[str]:
    """The console script beside this interpreter, else the module."""
    script = Path(sys.executable).with_name("hermes-sessions")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hermes_core"]


@dataclass
class Child:
    secs: float
    peak_mib: float
    code: int | None
    """None: killed at the timeout."""
    out: bytes


def tree_rss(process: psutil.Process) -> int:
    """The RSS of ``process`` and of every process it started (``export --jobs``' workers),
    summed; what cannot be read (a process just ended) counts as nothing."""
    total = 0
    with contextlib.suppress(psutil.Error):
        for each in (process, *process.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                total += each.memory_info().rss
    return total


def run_child(argv: Sequence[str], timeout: float, cap_mib: float = math.inf) -> Child:
    """Run ``argv`` with its output captured in a file: wall time and peak RSS of it and its
    children, sampled every 20 ms with psutil (``ru_maxrss`` of a child would include this
    process's own RSS, which a forked child starts with, and leaves out its children). A child
    past ``timeout`` seconds or ``cap_mib`` of RSS is killed (``code`` None)."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        process = psutil.Popen(argv, stdout=out, stderr=subprocess.DEVNULL)
        peak = 0
        while process.poll() is None:
            if time.perf_counter() - started > timeout or peak > cap_mib * 2**20:
                process.kill()
                process.wait()
                return Child(time.perf_counter() - started, peak / 2**20, None, b"")
            peak = max(peak, tree_rss(process))
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        out.seek(0)
        return Child(seconds, peak / 2**20, process.returncode, out.read())


def percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """p50 and p95 in ms."""
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return 1000 * statistics.median(ordered), 1000 * p95


def search_times(store: Store) -> dict[str, str]:
    """p50/p95 of 20 rare-term and 20 common-term searches."""
    config = _config(store.home, store.url)
    plugins = create_plugin_manager(config, load_entrypoints=False)
    figures = {}
    with SessionStore.open(config, plugins=plugins, read_only=True) as opened:
        for label, terms in (("rare", RARE[:20]), ("common", (COMMON,) * 20)):
            opened.search(terms[0])
            samples = []
            for term in terms:
                started = time.perf_counter()
                opened.search(term, limit=20)
                samples.append(time.perf_counter() - started)
            p50, p95 = percentiles(samples)
            figures[f"search {label} p50/p95 ms"] = f"{p50:.1f}/{p95:.1f}"
    return figures


def command_figures(store: Store, copy_url: str, timeout: float, cap: float) -> dict[str, str]:
    """The operator commands as child processes: wall time and peak RSS each."""
    lane = random.Random(store.lanes).randrange(store.lanes)
    commands = {
        "ls (first page)": ["ls", "--limit", "20"],
        "show": ["show", lane_key(lane)],
        "export": ["export", "--output", os.devnull],
        "doctor": ["doctor", "--json"],
        "migrate": ["migrate", "--to", copy_url, "--json"],
        "rekey (walk)": ["rekey", "--forum", "telegram", "1", "--json"],
        "prune": ["prune", "--days", "365", "--json"],
    }
    figures = {}
    for label, command in commands.items():
        child = run_child([*hermes_sessions(), *store.where, *command], timeout, cap)
        status = "" if child.code in (0, 1, None) else f" (exit {child.code})"
        if child.code is None:  # killed: the time or the memory it reached by then
            figures[f"{label} s / peak MiB"] = f">{child.secs:.0f} / >{child.peak_mib:.0f}"
        else:
            figures[f"{label} s / peak MiB"] = f"{child.secs:.2f} / {child.peak_mib:.0f}{status}"
        if label == "export" and child.code == 0:
            figures["export messages/s"] = f"{store.messages / child.secs:,.0f}"
    return figures


async def gateway_starts(store: Store, times: int = 2) -> list[float]:
    """Seconds a gateway takes to start on ``store``, each start after a clean stop."""
    seconds = []
    for _ in range(times):
        run = Run(store.home, store.url)
        started = time.perf_counter()
        await run.gateway.start()
        seconds.append(time.perf_counter() - started)
        await run.gateway.stop()
    return seconds


def measure(
    store: Store, small: Store, copy_url: str, turns: int, timeout: float, cap: float
) -> None:
    """Every figure of ``store`` (built), into ``store.figures``."""
    figures = store.figures
    figures["build s (lanes/s, messages/s)"] = (
        f"{store.build_secs:.0f} ({store.lanes / store.build_secs:,.0f}, "
        f"{store.messages / store.build_secs:,.0f})"
    )
    figures["size on disk MiB"] = f"{size_on_disk(store) / 2**20:,.0f}"
    for label in ("first open", "open"):  # the first records the key schema (see above)
        probe = [sys.executable, "-c", OPEN_PROBE, str(store.home), store.url or ""]
        opened = json.loads(run_child(probe, timeout).out)
        seconds, added = opened["secs"], opened["rss"] / 2**20
        figures[f"{label} s / RSS added MiB"] = f"{seconds:.2f} / {added:.0f}"
    many, same, few, fresh = asyncio.run(
        cold_lanes(store.home, small.home, min(turns, store.lanes - SMALL_SESSIONS),
                   store.lanes, (store.url, small.url))
    )  # fmt: skip
    figures["cold turn / cold turn, 1,000 lanes"] = f"{many.rate / fresh.rate:.2f}"
    figures["cold turn / warm turn, 1,000 lanes"] = f"{many.rate / few.rate:.2f}"
    figures["cold turn / 1,000 warm lanes"] = f"{many.rate / same.rate:.2f}"
    figures["cold turns/s (1,000 lanes: cold, warm)"] = (
        f"{many.rate:,.0f} ({fresh.rate:,.0f}, {few.rate:,.0f})"
    )
    writer, loop = "hermes-store-writer", "MainThread"
    figures["cold turn CPU us: writer / loop"] = (
        f"{many.thread_us(writer):.0f} / {many.thread_us(loop):.0f} "
        f"({fresh.thread_us(writer):.0f} / {fresh.thread_us(loop):.0f})"
    )
    starts = asyncio.run(gateway_starts(store))
    figures["gateway start s (twice)"] = " / ".join(f"{secs:.2f}" for secs in starts)
    figures.update(search_times(store))
    if copy_url.startswith("postgresql"):
        empty_postgres(copy_url)
    figures.update(command_figures(store, copy_url, timeout, cap))


def print_table(stores: Sequence[Store], where: str) -> None:
    """The figures of ``stores`` side by side, a row per measurement (columns two spaces
    apart at least, so a table pasted into a document splits on them)."""
    width = max(len(name) for name in ("measurement", *stores[0].figures)) + 1
    print(f"\n{where}")
    print(f"{'measurement':{width}}" + "".join(f" {s.lanes:>22,}" for s in stores))
    print(f"{'(messages)':{width}}" + "".join(f" {s.messages:>22,}" for s in stores))
    for name in stores[0].figures:
        print(f"{name:{width}}" + "".join(f" {s.figures.get(name, '-'):>22}" for s in stores))


def run_all(
    url: str | None, lanes: int, messages: int, turns: int, timeout: float, cap: float
) -> None:
    """Build and measure each size in turn, then print the table."""
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as directory:
        root = Path(directory)
        postgres = url is not None
        small_url = sibling_database(url, "_small") if url is not None else None
        copy_url = sibling_database(url, "_copy") if url is not None else ""
        small = Store(SMALL_SESSIONS, SMALL_SESSIONS * messages // lanes, root / "small", small_url)
        stores = []
        for size in (*[size for size in SIZES if size < lanes], lanes):
            store = Store(size, messages * size // lanes, root / f"lanes_{size}", url)
            print(f"building {size:,} lanes, {store.messages:,} messages", flush=True)
            build(store)
            build(small)  # afresh: the turns of a run leave their message ids as seen
            if not postgres:
                copy_url = f"sqlite:///{root / 'copy' / 'state.db'}"
                (root / "copy").mkdir(mode=0o700, exist_ok=True)
            measure(store, small, copy_url, turns, timeout, cap)
            print(json.dumps(store.figures), flush=True)
            stores.append(store)
            shutil.rmtree(store.home, ignore_errors=True)
            shutil.rmtree(small.home, ignore_errors=True)
            shutil.rmtree(root / "copy", ignore_errors=True)
    where = "SQLite (WAL, synchronous=normal)" if not postgres else "PostgreSQL"
    print_table(stores, f"{where}; {turns:,} cold turns per measurement")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="PostgreSQL URL (default: SQLite in a temporary directory)")
    parser.add_argument("--lanes", type=int, help="lanes of the largest store (1,000,000)")
    parser.add_argument("--messages", type=int, help="its messages (5,000,000)")
    parser.add_argument("--turns", type=int, help="cold turns per measurement (2,000)")
    parser.add_argument("--command-timeout", type=float, default=900.0, metavar="SECS")
    parser.add_argument(
        "--command-rss-cap", type=float, default=6144.0, metavar="MIB",
        help="kill an operator command past this RSS (default 6,144 MiB: the machine is shared)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="20,000 lanes, 100,000 messages")
    args = parser.parse_args(argv)
    lanes = args.lanes or (20_000 if args.quick else 1_000_000)
    messages = args.messages or (100_000 if args.quick else 5_000_000)
    turns = args.turns or (300 if args.quick else 2_000)
    if lanes <= SMALL_SESSIONS or messages < lanes:
        parser.error(f"--lanes must exceed {SMALL_SESSIONS:,} and --messages be at least --lanes")
    if args.url is not None and not args.url.startswith("postgresql"):
        parser.error("--url names a PostgreSQL database; leave it out for SQLite")
    started = time.perf_counter()
    run_all(args.url, lanes, messages, turns, args.command_timeout, args.command_rss_cap)
    print(f"whole run: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
