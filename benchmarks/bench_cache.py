"""Agent cache under memory pressure: 10,000 agents, a small budget, the real memory signal.

Each agent holds a transcript of ``--transcript-kib`` KiB (100 by default). Agents are inserted
one by one (miss, build, persistence reported), and the pressure sweep runs after every
``--sweep-every`` inserts, as housekeeping would. The budget is the process's anonymous memory
at the start plus ``--headroom-mib`` MiB. The script prints the budget, the peak of the signal
(sampled after every insert) and of RSS, the evictions, and the cost of hits, inserts and sweeps.

Run: ``python -m benchmarks.bench_cache [--agents N] [--sweep-every N] [--headroom-mib M]``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections.abc import Sequence

import psutil

from hermes_core.config.schema import AgentCacheConfig
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.memory import MIB, memory_signal


class Agent:
    """A stand-in agent whose live transcript is one large buffer."""

    def __init__(self, size: int) -> None:
        self.transcript: bytearray | None = bytearray(b"\x01") * size


def soft_release(agent: Agent) -> None:
    """Drop the in-memory transcript, as a host's soft release does."""
    agent.transcript = None


def signal_now() -> int:
    used = memory_signal()
    if used is None:
        raise SystemExit("the memory signal is unreadable on this machine")
    return used


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--transcript-kib", type=int, default=100)
    parser.add_argument("--sweep-every", type=int, default=16, help="inserts between sweeps")
    parser.add_argument("--headroom-mib", type=int, default=100, help="budget above the start")
    parser.add_argument("--per-pass", type=int, default=16, help="max_evictions_per_pass")
    parser.add_argument("--seconds", type=float, default=1.0, help="time for the hit rate")
    args = parser.parse_args(argv)
    size = args.transcript_kib * 1024
    gc.collect()
    start = signal_now()
    budget = start + args.headroom_mib * MIB
    settings = AgentCacheConfig(
        max_size=args.agents * 2, max_evictions_per_pass=args.per_pass, memory_high_mb="off"
    )
    cache: AgentCache[Agent] = AgentCache(
        settings, soft_release=soft_release, full_cleanup=soft_release, memory_budget_bytes=budget
    )
    process = psutil.Process()
    peak_signal = start
    peak_rss = process.memory_info().rss
    evictions = sweeps = 0
    sweep_time = insert_time = 0.0
    for index in range(args.agents):
        key = f"agent:main:telegram:dm:{index}"
        began = time.perf_counter()
        agent = cache.get_or_create(key, "fp", lambda: Agent(size))
        cache.report_persistence(key, agent, persisted=1, in_memory=1)
        insert_time += time.perf_counter() - began
        del agent
        if (index + 1) % args.sweep_every == 0:
            began = time.perf_counter()
            evictions += cache.sweep_pressure()
            sweep_time += time.perf_counter() - began
            sweeps += 1
        peak_signal = max(peak_signal, signal_now())
        peak_rss = max(peak_rss, process.memory_info().rss)
    keys = cache.keys()
    hits = 0
    began = time.perf_counter()
    deadline = began + args.seconds
    while time.perf_counter() < deadline:
        for key in keys:
            cache.get_or_create(key, "fp", lambda: Agent(size))
        hits += len(keys)
    hit_rate = hits / (time.perf_counter() - began)
    idle_sweep = time.perf_counter()
    cache.sweep_idle()
    idle_sweep = time.perf_counter() - idle_sweep
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    unbounded = args.agents * size
    print(
        f"agents inserted           : {args.agents:,} x {args.transcript_kib} KiB transcript "
        f"({unbounded / MIB:,.0f} MiB if all stayed cached)"
    )
    print(
        f"sweep                     : every {args.sweep_every} inserts, "
        f"max_evictions_per_pass {args.per_pass}, protect_recent 8"
    )
    print(f"anon memory at start      : {start / MIB:8.1f} MiB")
    print(f"budget (start + headroom) : {budget / MIB:8.1f} MiB")
    print(
        f"peak anon memory (signal) : {peak_signal / MIB:8.1f} MiB "
        f"({(peak_signal - budget) / MIB:+.1f} MiB vs budget)"
    )
    print(
        f"peak RSS (sampled)        : {peak_rss / MIB:8.1f} MiB; ru_maxrss {maxrss / MIB:.1f} MiB"
    )
    print(f"evictions                 : {evictions:,} in {sweeps:,} sweeps; {len(keys):,} cached")
    print(f"insert (miss + build)     : {args.agents / insert_time:12,.0f} ops/s")
    print(f"get, hit                  : {hit_rate:12,.0f} ops/s over {len(keys):,} keys")
    print(f"pressure sweep            : {sweep_time / max(sweeps, 1) * 1e6:12,.0f} us per sweep")
    print(f"idle sweep (none idle)    : {idle_sweep * 1e3:12,.2f} ms over {len(keys):,} entries")


if __name__ == "__main__":
    main()
