"""Resident memory of a gateway serving turns on distinct random lanes of a large store.

A store built by ``bench_scale`` (lane ``i`` keyed by ``bench_store.lane_key(i)``; pass its
``--state-dir``, and ``--url`` for PostgreSQL) is served by the real
``hermes_core.gateway.runtime.Gateway`` with ``EchoAgent``, configured as ``bench_runtime``'s
runs are (``bench_runtime._config``): ``T`` turns (``--turns``, default 100,000), each on another
lane drawn without repetition from all ``N`` (``--lanes``), 200 in flight. Every
``--every`` turns (default 10,000) the gateway is let go idle and the process's resident set
(psutil) is printed with the turns per second of that block: whatever the gateway keeps per lane
without a bound shows as RSS that keeps rising block after block, where bounded caches level
off once they are full. The store is opened once before the first sample (the first open of an
imported store reads every routing entry to tell its key schema: its memory is not the turns').

``--tracemalloc`` also traces allocations from the first block past a quarter of the turns
(when the bounded caches are full), takes a snapshot at the first block past half of them and
prints, after the last block, the 15 source lines whose live allocations grew the most since
that snapshot (what is still held, by size): entries a bounded cache replaced in between cancel
out, the structures that grow with the lanes served remain. Tracing slows the turns and adds
its own memory to the RSS of the blocks it runs in.

Run: ``python -m benchmarks.bench_memory --state-dir DIR --lanes N [--url URL] [--turns T]
[--every K] [--tracemalloc]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import random
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import psutil

from benchmarks.bench_runtime import IN_FLIGHT, Run, _config, _text
from benchmarks.bench_store import _source
from hermes_core import MessageEvent
from hermes_core.plugins.manager import create_plugin_manager
from hermes_core.store.session_store import SessionStore

TOP = 15


def _mib(size: float) -> str:
    return f"{size / 2**20:,.1f}"


async def serve(
    home: Path, url: str | None, lanes: int, turns: int, every: int, trace: bool
) -> None:
    """Drive the gateway and print one line per block of ``every`` turns."""
    process = psutil.Process()
    draw = random.Random(7).sample(range(lanes), turns + IN_FLIGHT)
    warm, draw = draw[:IN_FLIGHT], draw[IN_FLIGHT:]
    run = Run(home, url)
    await run.gateway.start()
    first: tracemalloc.Snapshot | None = None
    try:
        await run.measure(None, _events(warm, turns), IN_FLIGHT)
        gc.collect()
        print(f"{'turns':>9} {'RSS MiB':>9} {'change':>8} {'turns/s':>8}")
        print(f"{0:9,} {_mib(start := process.memory_info().rss):>9} {'':>8} {'':>8}")
        previous = start
        for done in range(every, turns + 1, every):
            began = time.perf_counter()
            await run.measure(None, _events(draw[done - every : done], done), IN_FLIGHT)
            rate = every / (time.perf_counter() - began)
            gc.collect()
            rss = process.memory_info().rss
            print(f"{done:9,} {_mib(rss):>9} {_mib(rss - previous):>8} {rate:8,.0f}", flush=True)
            previous = rss
            if trace and not tracemalloc.is_tracing() and done >= turns // 4:
                tracemalloc.start(1)
            elif trace and first is None and done >= turns // 2:
                first = tracemalloc.take_snapshot()
        if first is not None:
            grown = tracemalloc.take_snapshot().compare_to(first, "lineno")
            print("\nlargest growth of live allocations over the second half of the turns:")
            for stat in grown[:TOP]:
                print(f"  {_mib(stat.size_diff):>8} MiB {stat.count_diff:+10,}  {stat.traceback}")
    finally:
        await run.gateway.stop()
    print(f"RSS grew {_mib(previous - start)} MiB over {turns:,} turns on as many lanes")


RUN = f"{time.time_ns():x}"
"""Part of every message id: a second run on the same store must not send ids its lanes have
seen (they would be dropped as redeliveries)."""


def _events(lanes: Sequence[int], first: int) -> list[MessageEvent]:
    """One message to each of ``lanes``, numbered from ``first`` (no per-lane state kept)."""
    return [
        MessageEvent(source=_source(lane), text=_text(first + n), message_id=f"{RUN}-{first + n}")
        for n, lane in enumerate(lanes)
    ]


def _open_once(home: Path, url: str | None) -> None:
    """Open and close the store (in a child process: see the module's docstring)."""
    config = _config(home, url)
    SessionStore.open(config, plugins=create_plugin_manager(config)).close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, required=True, help="the store's home")
    parser.add_argument("--lanes", type=int, required=True, help="lanes in the store")
    parser.add_argument("--url", help="storage URL (default: SQLite in the state dir)")
    parser.add_argument("--turns", type=int, default=100_000, help="turns (default 100,000)")
    parser.add_argument("--every", type=int, default=10_000, help="turns per sample (10,000)")
    parser.add_argument("--tracemalloc", action="store_true", help="print what grew, by line")
    args = parser.parse_args(argv)
    if not 0 < args.turns <= args.lanes - IN_FLIGHT:
        parser.error(f"--turns must be between 1 and --lanes less {IN_FLIGHT}")
    if not 0 < args.every <= args.turns:
        parser.error("--every must be between 1 and --turns")
    opening = multiprocessing.Process(target=_open_once, args=(args.state_dir, args.url))
    opening.start()
    opening.join()
    asyncio.run(
        serve(args.state_dir, args.url, args.lanes, args.turns, args.every, args.tracemalloc)
    )


if __name__ == "__main__":
    main()
