"""Several gateway processes on one PostgreSQL database (``storage.instances: shared``).

Each run starts ``N`` real ``hermes_core.gateway.runtime.Gateway`` processes (``multiprocessing``,
spawn; their side is ``benchmarks.instance_process``), each with its own ``$HERMES_HOME`` (so its
own instance id), on the database named by
``--url``, whose ``public`` schema is dropped and created once before the first run. The driver
(this process) feeds them through pipes and counts a turn when its reply reached an adapter
(the gateway's ``send``); every message must get exactly one reply, ``echo: <text>``, or the run
fails. The agent echoes after ``think`` seconds (asyncio wait; no CPU). Housekeeping, busy
acknowledgements, the ``sessions.json`` mirror and third-party plugins are off; busy input is
queued (never merged); ``turn_lease_secs`` is the default 120 (renewal every 30 s), but
``storage.lease_scan_secs`` is 3,600, so the scan for expired or missing leases never runs and
the figures compare with earlier runs; ``--lease-scan-secs 2`` runs with the default scan (which
once took over lanes a live process had just queued to, duplicating or stalling replies).

Traffic over 1,000 lanes (DM chats): each process has ``K`` slots; a free slot of process ``p``
sends the next message to ``p``. A lane has at most one message in flight. When a lane's reply
arrives, the lane is, with probability 1/2, *followed up*: its next message goes at once to the
next free slot of a process other than the one that ran the reply (with one process, to that
process); otherwise it goes to the back of the queue of idle lanes, which free slots take when
no follow-up is waiting for them. So a lane's messages arrive at different processes over time,
half of them right after the previous reply (while the previous process may still hold the
lane's lease) and half long after it released it.

A run is one fleet of processes, for both scenarios: the processes start; warm-up turns,
excluded, with no think time and 32 slots per process (the benchmark's first run: one turn on
each lane, which creates its session; later runs: 32 turns per process); then, for each
scenario, the driver waits until every process is idle (no lane running or leased) and runs the
measured phase of ``turns`` turns per process; the clock runs from the first message to the
last reply; the driver waits until all are idle again (the turns' last commits
and lease releases count in their CPU). Then the processes stop. The benchmark makes three
rounds of the four runs (see below), so that the figures it compares come from the same
minutes of a machine whose speed drifts (one run's CPU per turn moved by a fifth between two
runs a minute apart); each figure is the total over the rounds, and each target line gives, in
brackets, its lowest and highest value in one round.

Figures of a scenario over the rounds:

- turns/s: measured turns / wall seconds; "x 1proc": against 1 process with the same
  configuration.
- CPU per turn: user + system time of the gateway processes (all threads; ``psutil``, which
  reads ``/proc/<pid>/stat``) and of the PostgreSQL backends serving the database (the pids in
  ``pg_stat_activity`` for it, the driver's own connection excluded, read every 0.5 s and at
  both ends; a backend that exits loses at most its last 0.5 s; server-wide processes such as
  the WAL writer and checkpointer are not counted), between the two idle points, divided by the
  measured turns. "x single": against one process with ``storage.instances: single`` (no
  leases; the writer lock).
- round trips per turn: the gateways' ``store.stats()`` ``round_trips`` differences.
- ours: the CPU of the gateways and backends per wall second of the measured phase (cores).
- busy: the machine's busy share from ``/proc/stat`` over the measured phase (all processes,
  others' work included), in cores of ``os.cpu_count()``.
- hand-off latency: for a measured message of a lane whose previous message was also measured,
  ``ready`` is the later of its arrival (the receiving process called ``handle_message``) and
  the previous reply's send, and its latency is the start of its agent turn minus ``ready``
  (one host, ``CLOCK_MONOTONIC``). A *hand-off* is a message received by a process other than
  the one that ran the lane's previous turn; it runs either there (the lease moved) or, when
  the previous process still held the lease and saw the queued message before releasing, in
  the previous process. Latencies of hand-offs (p50, p95) are printed beside those of the other
  messages (received where the previous turn ran).

Scenarios: think 400 ms with 8 slots per process (throughput), and think 50 ms with 32 slots per
process (CPU per turn); runs, at default settings (2 writer connections single, 1 shared): 1
process with ``storage.instances: single``, the same with one writer connection (``single/1w``),
then 1, 2 and 4 with ``shared``. The CPU target (at most 1.25 x) is printed against the one
shared process (what sharing lanes adds), the one single-instance process (what the leases cost
in all) and, for 4 processes, ``single/1w`` (the leases alone, with alike writer connections).

Run: ``python -m benchmarks.bench_instances [--url URL] [--quick] [--lease-scan-secs S]``;
``--url`` defaults to ``$HERMES_TEST_POSTGRES_URL``; ``--quick`` is a smoke run with an eighth
of the turns.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import multiprocessing.connection
import os
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import Engine, create_engine, make_url, text

from benchmarks.instance_process import IDLE_SECS, Setup, gateway_process

SPAWN = multiprocessing.get_context("spawn")
LANES = 1_000
CHAT_BASE = 3_000_000
WARM_SLOTS = 32
ROUNDS = 3
"""Rounds of the runs."""
FOLLOW_UP = 0.5
"""Share of replies after which the lane's next message goes at once to another process."""
STALL_SECS = 60.0
"""A phase fails when no reply arrived for this long."""
SAMPLE_SECS = 0.5
"""How often the PostgreSQL backends' CPU is read during a phase."""
NUMBERS = itertools.count()
"""Message numbers, never reused in one benchmark run (a reused message id is a duplicate)."""
SCAN_SECS = 3600.0
"""``storage.lease_scan_secs``: in effect no scan for expired leases (see the docstring)."""


@dataclass(frozen=True)
class Scenario:
    label: str
    think: float
    slots: int
    turns: int
    """Measured turns per process."""


class DriverError(RuntimeError):
    """A reply was missing, doubled, unexpected or wrong, or a process failed."""


# -- the driver ------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float | None:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


class Backends:
    """CPU seconds of the PostgreSQL backends serving the database, read from time to time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seen: dict[int, float] = {}
        self.first: dict[int, float] = {}

    def sample(self) -> None:
        with self.engine.connect() as conn:
            pids = conn.execute(text(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )).scalars().all()  # fmt: skip
        for pid in pids:
            seconds = _cpu_seconds(pid)
            if seconds is not None:
                self.seen[pid] = seconds

    def start(self) -> None:
        self.seen = {}
        self.sample()
        self.first = dict(self.seen)

    def used(self) -> float:
        """Seconds used since :meth:`start` (a backend started since counts from zero)."""
        return sum(seconds - self.first.get(pid, 0.0) for pid, seconds in self.seen.items())


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``."""
    line = Path("/proc/stat").read_text().split("\n")[0]
    fields = [int(value) for value in line.split()[1:9]]  # guest time is within user time
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class Message:
    lane: int
    to: int
    text: str
    previous: str | None
    """The lane's previous message id of the same phase."""
    reply_at: float = 0.0
    runner: int = -1


@dataclass
class Figures:
    """What one run measured."""

    scenario: Scenario
    instances: str
    processes: int
    turns: int = 0
    seconds: float = 0.0
    gateway_cpu: float = 0.0
    postgres_cpu: float = 0.0
    trips: int = 0
    """Round trips of the gateways' stores."""
    busy_seconds: float = 0.0
    """The machine's busy core-seconds."""
    handoffs: list[float] = field(default_factory=list)
    relayed: int = 0
    local: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.turns / self.seconds

    @property
    def cpu_ms(self) -> float:
        return 1000 * (self.gateway_cpu + self.postgres_cpu) / self.turns

    @property
    def round_trips(self) -> float:
        return self.trips / self.turns

    @property
    def busy_cores(self) -> float:
        return self.busy_seconds / self.seconds

    def add(self, other: Figures) -> None:
        """Count another round of the same scenario and fleet size in."""
        self.turns += other.turns
        self.seconds += other.seconds
        self.gateway_cpu += other.gateway_cpu
        self.postgres_cpu += other.postgres_cpu
        self.trips += other.trips
        self.busy_seconds += other.busy_seconds
        self.handoffs += other.handoffs
        self.relayed += other.relayed
        self.local += other.local


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Fleet:
    """``processes`` gateway processes and the traffic the driver sends them."""

    def __init__(self, root: Path, setup: Setup, processes: int) -> None:
        self.conns: list[Connection] = []
        self.children: list[multiprocessing.process.BaseProcess] = []
        self.pids: list[int] = []
        for index in range(processes):
            mine, theirs = SPAWN.Pipe()
            home = root / f"home-{index}"
            home.mkdir(mode=0o700)
            child = SPAWN.Process(target=gateway_process, args=(str(home), setup, theirs))
            child.start()
            theirs.close()
            self.conns.append(mine)
            self.children.append(child)
        for conn in self.conns:
            self.pids.append(int(self._expect(conn, "ready")[1]))
        self.rng = random.Random(14)
        self.idle_lanes = deque(self.rng.sample(range(LANES), LANES))
        self.follow_ups: deque[tuple[int, int]] = deque()
        """(lane, the process that ran its last turn), oldest first."""
        self.waiting: dict[str, str] = {}
        """Chat -> the id of its message in flight."""
        self.last: dict[int, str] = {}
        """Lane -> its last message id of this phase."""

    def _expect(self, conn: Connection, kind: str) -> tuple[Any, ...]:
        if not conn.poll(IDLE_SECS + 60):
            raise DriverError(f"a gateway process sent no {kind!r} in time")
        item: tuple[Any, ...] = conn.recv()
        if item[0] != kind:
            raise DriverError(f"a gateway process sent {item!r}, expected {kind!r}")
        return item

    def idle(self) -> list[dict[str, int]]:
        """Wait until every process has no turn running and no lease held; their stats."""
        for conn in self.conns:
            conn.send(("idle",))
        stats = []
        for conn in self.conns:
            _, counters, held = self._expect(conn, "idle")
            if held:
                raise DriverError(f"a gateway process still holds {held} leases")
            stats.append(counters)
        return stats

    def cpu(self) -> float:
        return sum(_cpu_seconds(pid) or 0.0 for pid in self.pids)

    def _next_lane(self, process: int) -> int | None:
        for index, (lane, ran) in enumerate(self.follow_ups):
            if ran != process or len(self.conns) == 1:
                del self.follow_ups[index]
                return lane
        return self.idle_lanes.popleft() if self.idle_lanes else None

    def _send(self, process: int, lane: int, think: float, sent: dict[str, Message]) -> None:
        message_id = f"m{next(NUMBERS)}-{round(think * 1000)}"
        chat = str(CHAT_BASE + lane)
        words = f"{message_id}: what is the weather like in Kuala Lumpur this afternoon?"
        sent[message_id] = Message(lane, process, words, self.last.get(lane))
        self.last[lane] = message_id
        self.waiting[chat] = message_id
        self.conns[process].send(("message", message_id, chat, words))

    def phase(
        self, turns: int, slots: int, think: float, tick: Callable[[], None]
    ) -> dict[str, Message]:
        """Run ``turns`` turns with ``slots`` per process and ``think`` seconds per turn (none:
        a warm-up, without follow-ups); the messages sent, by id."""
        warm = not think
        sent: dict[str, Message] = {}
        self.last = {}
        free = [slots] * len(self.conns)
        issued = replied = 0

        def fill() -> None:
            nonlocal issued
            for process, slots_free in enumerate(free):
                for _ in range(slots_free):
                    lane = self._next_lane(process) if issued < turns else None
                    if lane is None:
                        break
                    self._send(process, lane, think, sent)
                    free[process] -= 1
                    issued += 1

        fill()
        sampled = time.monotonic()
        while replied < turns:
            ready = multiprocessing.connection.wait(self.conns, timeout=STALL_SECS)
            if not ready:
                raise DriverError(f"no reply for {STALL_SECS:g} s ({len(self.waiting)} awaited)")
            for runner, conn in enumerate(self.conns):
                while conn in ready and conn.poll():
                    replied += self._on_reply(runner, conn.recv(), sent, free, warm)
            fill()
            if time.monotonic() - sampled > SAMPLE_SECS:
                tick()
                sampled = time.monotonic()
        return sent

    def _on_reply(
        self,
        runner: int,
        item: tuple[Any, ...],
        sent: dict[str, Message],
        free: list[int],
        warm: bool,
    ) -> int:
        if item[0] != "reply":
            raise DriverError(f"gateway process {runner}: {item!r}")
        _, chat, words, at = item
        message_id = self.waiting.pop(chat, None)
        if message_id is None:
            raise DriverError(f"a reply nobody awaited (chat {chat}): {words!r}")
        message = sent[message_id]
        if words != f"echo: {message.text}":
            raise DriverError(f"chat {chat}: expected the echo of {message.text!r}: {words!r}")
        message.reply_at, message.runner = at, runner
        free[message.to] += 1
        if not warm and self.rng.random() < FOLLOW_UP:
            self.follow_ups.append((message.lane, runner))
        else:
            self.idle_lanes.append(message.lane)
        return 1

    def stop(self) -> tuple[dict[str, float], dict[str, float]]:
        """Stop every process; the turn starts and message arrivals they recorded."""
        starts: dict[str, float] = {}
        arrivals: dict[str, float] = {}
        for conn in self.conns:
            conn.send(("stop",))
        for conn in self.conns:
            _, begun, arrived = self._expect(conn, "done")
            starts.update(begun)
            arrivals.update(arrived)
        for child in self.children:
            child.join(60)
            if child.exitcode != 0:
                raise DriverError(f"a gateway process exited with {child.exitcode}")
        return starts, arrivals

    def kill(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.kill()
                child.join(10)


def _latencies(
    figures: Figures, sent: dict[str, Message], starts: dict[str, float], arrivals: dict[str, float]
) -> None:
    """Hand-off and local latencies (see the module docstring)."""
    for message_id, message in sent.items():
        if message.previous is None:
            continue
        previous = sent[message.previous]
        latency = starts[message_id] - max(arrivals[message_id], previous.reply_at)
        if message.to == previous.runner:
            figures.local.append(latency)
        else:
            figures.handoffs.append(latency)
            figures.relayed += message.runner == previous.runner


def _measure(
    fleet: Fleet, engine: Engine, scenario: Scenario, instances: str
) -> tuple[Figures, dict[str, Message]]:
    """One scenario's measured phase on an idle fleet, which is left idle."""
    processes = len(fleet.conns)
    figures = Figures(scenario, instances, processes)
    backends = Backends(engine)
    before = fleet.idle()
    backends.start()
    cpu = fleet.cpu()
    busy, total = _machine_ticks()
    started = time.monotonic()
    turns = figures.turns = scenario.turns * processes
    sent = fleet.phase(turns, scenario.slots, scenario.think, backends.sample)
    figures.seconds = time.monotonic() - started
    busy_after, total_after = _machine_ticks()
    after = fleet.idle()
    figures.gateway_cpu = fleet.cpu() - cpu
    backends.sample()
    figures.postgres_cpu = backends.used()
    cores = (busy_after - busy) / (total_after - total) * (os.cpu_count() or 1)
    figures.busy_seconds = cores * figures.seconds
    pairs = zip(before, after, strict=True)
    figures.trips = sum(b["round_trips"] - a["round_trips"] for a, b in pairs)
    return figures, sent


def run(
    root: Path, engine: Engine, scenarios: Sequence[Scenario], setup: Setup, processes: int,
    warm: int,
) -> list[Figures]:  # fmt: skip
    """One fleet: ``warm`` warm-up turns, then each scenario (see the module docstring)."""
    fleet = Fleet(Path(tempfile.mkdtemp(dir=root)), setup, processes)
    try:
        fleet.phase(warm, WARM_SLOTS, 0.0, lambda: None)
        measured = [_measure(fleet, engine, scenario, setup.label) for scenario in scenarios]
        starts, arrivals = fleet.stop()
    except BaseException:
        fleet.kill()
        raise
    for figures, sent in measured:
        replied = sum(1 for message in sent.values() if message.runner >= 0)
        if replied != figures.turns or len(sent) != figures.turns:
            raise DriverError(f"{figures.turns} turns, {len(sent)} sent, {replied} replied")
        _latencies(figures, sent, starts, arrivals)
    return [figures for figures, _ in measured]


def _empty(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))


HEADER = (
    f"{'instances':9} {'procs':>5} {'turns':>6} {'turns/s':>8} {'x 1proc':>7} {'gw ms':>6} "
    f"{'pg ms':>6} {'CPU ms':>6} {'x single':>8} {'rtrips':>6} {'ours':>5} {'busy':>5} "
    f"{'hand-offs':>9} "
    f"{'relayed':>7} {'p50':>6} {'p95':>6} {'local p50':>9} {'p95':>6}"
)


def _ms(values: Sequence[float], share: float) -> str:
    return f"{1000 * _percentile(values, share):6.1f}" if values else f"{'-':>6}"


def _row(figures: Figures, one: Figures, single: Figures) -> str:
    return (
        f"{figures.instances:9} {figures.processes:5} {figures.turns:6} {figures.rate:8.1f} "
        f"{figures.rate / one.rate:7.2f} {1000 * figures.gateway_cpu / figures.turns:6.2f} "
        f"{1000 * figures.postgres_cpu / figures.turns:6.2f} {figures.cpu_ms:6.2f} "
        f"{figures.cpu_ms / single.cpu_ms:8.2f} {figures.round_trips:6.2f} "
        f"{(figures.gateway_cpu + figures.postgres_cpu) / figures.seconds:5.2f} "
        f"{figures.busy_cores:5.2f} {len(figures.handoffs):9} {figures.relayed:7} "
        f"{_ms(figures.handoffs, 0.5)} {_ms(figures.handoffs, 0.95)} "
        f"{_ms(figures.local, 0.5):>9} {_ms(figures.local, 0.95)}"
    )


def _target(label: str, value: float, rounds: Sequence[float], target: float, at_most: bool) -> str:
    met = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    spread = f"({min(rounds):.2f}-{max(rounds):.2f})"
    return (
        f"{label:58} {value:6.2f} {spread:11}  target {sign} {target:<4g} "
        f"{'met' if met else 'MISSED'}"
    )


PLAN: tuple[tuple[str, int | None, int], ...] = (
    ("single", None, 1), ("single", 1, 1), ("shared", None, 1), ("shared", None, 2),
    ("shared", None, 4),
)  # fmt: skip
"""(instances, writer connections or None for the default, processes) of each run."""
LIKE_FOR_LIKE = "single/1w"
"""The single-instance process with one writer connection, as a shared one has by default."""
Results = dict[tuple[str, str, int], Figures]
"""(scenario label, configuration label, processes) -> figures."""


def run_all(url: str, scenarios: Sequence[Scenario], lease_scan_secs: float) -> None:
    """Every scenario's runs, round after round, then one table and the targets."""
    engine = create_engine(url, pool_size=1)
    _empty(engine)
    rounds: list[Results] = []
    plan = [(Setup(url, instances, lease_scan_secs, writers), n) for instances, writers, n in PLAN]
    with tempfile.TemporaryDirectory() as directory:
        for number in range(1, ROUNDS + 1):
            results: Results = {}
            for setup, processes in plan:
                warm = WARM_SLOTS * processes if rounds or results else LANES
                for figures in run(Path(directory), engine, scenarios, setup, processes, warm):
                    results[figures.scenario.label, setup.label, processes] = figures
                    print(f"  round {number}: {figures.scenario.label}: {setup.label} x "
                          f"{processes}: {figures.rate:.1f} turns/s", flush=True)  # fmt: skip
            rounds.append(results)
    engine.dispose()
    totals: Results = {}
    for results in rounds:
        for key, figures in results.items():
            if key in totals:
                totals[key].add(figures)
            else:
                totals[key] = replace(
                    figures, handoffs=list(figures.handoffs), local=list(figures.local)
                )
    where = make_url(url).render_as_string(hide_password=True)
    print(f"\nGateway processes on PostgreSQL ({where}), {LANES:,} lanes, "
          f"{os.cpu_count()} cores; CPU in ms per turn; totals of {ROUNDS} rounds")  # fmt: skip
    print(HEADER)
    for scenario in scenarios:
        print(f"-- {scenario.label}")
        single = totals[scenario.label, "single", 1]
        for setup, processes in plan:
            one = totals[scenario.label, setup.label, 1]
            print(_row(totals[scenario.label, setup.label, processes], one, single))
    print()
    _targets(scenarios, totals, rounds)


def _rate_ratio(results: Results, label: str, baseline: str) -> float:
    """Turns/s of 4 shared processes against 1 ``baseline`` process (a configuration label)."""
    return results[label, "shared", 4].rate / results[label, baseline, 1].rate


def _cpu_ratio(results: Results, label: str, processes: int, baseline: str) -> float:
    """CPU per turn of ``processes`` shared processes against 1 ``baseline`` process."""
    return results[label, "shared", processes].cpu_ms / results[label, baseline, 1].cpu_ms


def _targets(scenarios: Sequence[Scenario], totals: Results, rounds: list[Results]) -> None:
    """The target lines: each ratio over the totals, and its range over the rounds."""
    throughput, cpu = scenarios[0].label, scenarios[1].label
    for baseline in ("shared", "single"):
        value = _rate_ratio(totals, throughput, baseline)
        each = [_rate_ratio(results, throughput, baseline) for results in rounds]
        label = f"{throughput}: turns/s, 4 shared / 1 {baseline}"
        print(_target(label, value, each, 3.0, False))
    for baseline, fleets in (("shared", (2, 4)), ("single", (1, 2, 4)), (LIKE_FOR_LIKE, (4,))):
        for processes in fleets:
            value = _cpu_ratio(totals, cpu, processes, baseline)
            each = [_cpu_ratio(results, cpu, processes, baseline) for results in rounds]
            label = f"{cpu}: CPU/turn, {processes} shared / 1 {baseline}"
            print(_target(label, value, each, 1.25, True))
    handoffs = totals[throughput, "shared", 4].handoffs
    if handoffs:
        print(f"{throughput}, 4 shared: hand-off latency p95 {_ms(handoffs, 0.95).strip()} ms")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--url", default=os.environ.get("HERMES_TEST_POSTGRES_URL"),
        help="PostgreSQL URL of a database whose public schema may be emptied "
        "(default: $HERMES_TEST_POSTGRES_URL)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: an eighth of the turns")
    parser.add_argument(
        "--lease-scan-secs", type=float, default=SCAN_SECS,
        help=f"storage.lease_scan_secs of the gateways (default {SCAN_SECS:g}: see the docstring)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.url or not args.url.startswith("postgresql"):
        parser.error("--url postgresql+psycopg://... (or $HERMES_TEST_POSTGRES_URL) is required")
    share = 8 if args.quick else 1
    scenarios = (
        Scenario("think 400 ms, 8 in flight per process", 0.4, 8, 240 // share),
        Scenario("think 50 ms, 32 in flight per process", 0.05, 32, 1_200 // share),
    )
    started = time.perf_counter()
    run_all(args.url, scenarios, args.lease_scan_secs)
    print(f"whole run: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
