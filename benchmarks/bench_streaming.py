"""Streamed replies with many chats at once: edits per chat against the configured interval, and
what the store pays for a streamed turn beside a turn whose agent returns a finished string.

The real ``Gateway`` on SQLite in a temporary directory (or ``--url``, a PostgreSQL database whose
tables are dropped first) over an in-memory adapter that can edit what it posted (it records when
each message was posted and edited). ``--chats`` chats (default 200) each get one message at
once; each agent streams a reply of 40 chunks, one every 25 ms (about a second of writing), and
``streaming.edit_interval_secs`` is ``--interval`` (default 0.25 s).

1. Edits: for every message, its edits per second over its life (from its post to its last edit)
   and the shortest gap between two of its edits; the target is that no chat is edited more
   often than once per interval (the last edit, the delivery of the finished reply, may follow
   sooner).
2. Store cost: the same waves of turns with agents that return the same reply as one finished
   string, alternating with the streamed waves (3 rounds each); commits, round trips and writer
   steps per turn from ``store.stats()``, and the process's CPU time per turn. Target: a streamed
   turn at most 1.2 times a finished one (round trips).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from benchmarks.bench_runtime import COUNTERS, empty_postgres
from hermes_core import (
    Agent,
    Gateway,
    GatewayConfig,
    MessageEvent,
    Posted,
    SendResult,
    SessionSource,
    TurnRequest,
    create_plugin_manager,
)

CHUNKS = [f"token{n:02d} " for n in range(40)]
PAUSE = 0.025
ROUNDS = 3


class Chats:
    """An editing adapter that keeps each message's post and edit times."""

    platform = "telegram"
    message_limit = 4096

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.texts: dict[str, str] = {}
        self.sent = 0

    def measure(self, text: str) -> int:
        return len(text)

    def is_connected(self) -> bool:
        return True

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        message_id = f"m{len(self.times) + 1}"
        self.times[message_id] = [time.monotonic()]
        self.texts[message_id] = text
        return Posted(SendResult(ok=True), message_id)

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        self.times[message_id].append(time.monotonic())
        self.texts[message_id] = text
        return SendResult(ok=True)

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        self.sent += 1
        return SendResult(ok=True)


class Streaming(Agent):
    async def run_turn(self, request: TurnRequest) -> AsyncIterator[str]:
        for chunk in CHUNKS:
            await asyncio.sleep(PAUSE)
            yield chunk


class Finished(Agent):
    async def run_turn(self, request: TurnRequest) -> str | None:
        await asyncio.sleep(PAUSE * len(CHUNKS))
        return "".join(CHUNKS)


async def _wave(gateway: Gateway, tag: str, chats: int) -> tuple[dict[str, int], float, float]:
    """One message to each of ``chats`` new chats, until every turn closed: the store counters
    spent, the process CPU seconds and the wall seconds."""
    store = gateway.store
    before, cpu, began = store.stats(), time.process_time(), time.monotonic()
    for n in range(chats):
        source = SessionSource(platform="telegram", chat_id=f"{tag}{n}", user_id=f"{tag}{n}")
        await gateway.handle_message(MessageEvent(source=source, text="go", message_id=f"{n}"))
    await gateway.idle()
    after = store.stats()
    spent = {name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    return spent, time.process_time() - cpu, time.monotonic() - began


async def _bench(args: argparse.Namespace) -> None:
    if args.url:
        empty_postgres(args.url)
    with tempfile.TemporaryDirectory() as home:
        data: dict[str, Any] = {
            "streaming": {"edit_interval_secs": args.interval},
            "gateway": {"busy_ack_enabled": False, "write_sessions_json": False,
                        "housekeeping": {"initial_delay_secs": 1e6}},
            "agent": {"agent_cache": {"max_size": 4 * args.chats}},
            "plugins": {"autoload": False},
        }  # fmt: skip
        if args.url:
            data["storage"] = {"url": args.url}
        config = GatewayConfig.from_dict(data, environ={"HERMES_HOME": home})
        chats = Chats()
        mode = {"agent": "stream"}

        def agents(entry: Any) -> Agent:
            return Streaming() if mode["agent"] == "stream" else Finished()

        totals: dict[str, dict[str, float]] = {"stream": {}, "finished": {}}
        async with Gateway(config, create_plugin_manager(config), agents, [chats]) as gateway:
            for round_ in range(ROUNDS):
                for kind in ("stream", "finished"):
                    mode["agent"] = kind
                    spent, cpu, _ = await _wave(gateway, f"{kind[0]}{round_}-", args.chats)
                    total = totals[kind]
                    for name, value in spent.items():
                        total[name] = total.get(name, 0) + value
                    total["cpu"] = total.get("cpu", 0) + cpu
        _report(args, chats, totals)


def _report(args: argparse.Namespace, chats: Chats, totals: dict[str, dict[str, float]]) -> None:
    turns = ROUNDS * args.chats
    rates: list[float] = []
    gaps: list[float] = []
    for stamps in chats.times.values():
        edits = stamps[1:]
        if len(edits) >= 2:
            rates.append((len(edits) - 1) / (edits[-2] - stamps[0]) if edits[-2] > stamps[0] else 0)
            gaps.extend(b - a for a, b in itertools.pairwise(stamps[:-1]))
    finished_text = "".join(CHUNKS)
    complete = sum(text == finished_text for text in chats.texts.values())
    store = "PostgreSQL" if args.url else "SQLite"
    print(f"{args.chats} chats streaming at once, {ROUNDS} rounds, {store} store, "
          f"edit interval {args.interval} s")  # fmt: skip
    print(f"  streamed messages: {len(chats.times)}, ending with the finished text: {complete}")
    if rates:
        print(f"  edits per second per chat (before the final edit): max {max(rates):.2f}, "
              f"median {statistics.median(rates):.2f}; limit {1 / args.interval:.2f}")  # fmt: skip
        print(f"  shortest gap between two edits of one message: {min(gaps) * 1000:.0f} ms "
              f"(interval {args.interval * 1000:.0f} ms)")  # fmt: skip
    print(f"  {'per turn':22} {'streamed':>9} {'finished':>9} {'ratio':>6}")
    for name in (*COUNTERS, "cpu"):
        streamed, finished = (
            totals["stream"].get(name, 0) / turns,
            totals["finished"].get(name, 0) / turns,
        )
        scale = 1e6 if name == "cpu" else 1
        label = "cpu us" if name == "cpu" else name
        ratio = streamed / finished if finished else float("nan")
        print(f"  {label:22} {streamed * scale:9.2f} {finished * scale:9.2f} {ratio:6.2f}")
    print("  target: round trips per streamed turn at most 1.2 times a finished turn's")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chats", type=int, default=200, help="chats streaming at once")
    parser.add_argument("--interval", type=float, default=0.25, help="edit interval, seconds")
    parser.add_argument("--url", help="a PostgreSQL URL (default: SQLite in a temporary directory)")
    asyncio.run(_bench(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
