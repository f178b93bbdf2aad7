"""End-to-end turns through ``Gateway.handle_message`` beside the store-only cost of the same turns.

Both run on a SQLite store holding 10,000 sessions, with ``EchoAgent`` and the in-memory adapter,
in the same run. The store-only figure runs the durable steps of a turn (``TurnPipeline``: user
message with the marker, reply, ledger record, send, delivery, closing) synchronously; the runtime
figure adds everything the gateway does around them: key building, queue checks, the agent cache,
the session-context prompt, worker-thread hops and the asyncio task per turn.

Run: ``python -m benchmarks.bench_runtime [--turns N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_store import _source, populate
from hermes_core import GatewayConfig, MessageEvent
from hermes_core.agents import EchoAgent, InMemoryAdapter
from hermes_core.ledger import SendResult
from hermes_core.pipeline import Turn, TurnPipeline
from hermes_core.recovery import GatewayState
from hermes_core.runtime import Gateway
from hermes_core.store.backend import Obligation
from hermes_core.testing import fresh_plugin_manager

SESSIONS = 10_000
LANES = 200


def _config(home: Path) -> GatewayConfig:
    settings = {"gateway": {"housekeeping": {"initial_delay_secs": 3600}}}
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def _events(turns: int) -> list[MessageEvent]:
    return [
        MessageEvent(source=_source(turn % LANES), text=f"question {turn}", message_id=f"m{turn}")
        for turn in range(turns)
    ]


def store_only(home: Path, turns: int) -> float:
    """Turns per second of the durable steps alone, run synchronously."""
    config = _config(home)
    state = GatewayState(config, plugins=fresh_plugin_manager(home))
    store = state.start()
    pipeline = TurnPipeline(store, config)

    def send(row: Obligation, text: str) -> SendResult:
        return SendResult(ok=True)

    def agent(turn: Turn) -> str:
        return f"echo: {turn.event.text}"

    events = _events(turns)
    start = time.perf_counter()
    for event in events:
        pipeline.run(event, agent, send)
    rate = turns / (time.perf_counter() - start)
    state.stop(drained=True)
    return rate


async def through_gateway(home: Path, turns: int, *, concurrent: bool) -> float:
    """Turns per second through ``handle_message``: one at a time (each awaited to its
    delivery), or one message per lane at a time for all lanes at once (as a busy gateway)."""
    config = _config(home)
    adapter = InMemoryAdapter()
    gateway = Gateway(config, fresh_plugin_manager(home), lambda entry: EchoAgent(), [adapter])
    await gateway.start()
    events = _events(turns)
    start = time.perf_counter()
    batch = LANES if concurrent else 1
    for first in range(0, turns, batch):
        for event in events[first : first + batch]:
            await gateway.handle_message(event)
        await gateway.idle()
    rate = turns / (time.perf_counter() - start)
    await gateway.stop()
    if len(adapter.sent) != turns:
        raise SystemExit(f"expected {turns} replies, got {len(adapter.sent)}")
    return rate


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=2000, help="turns per measurement")
    args = parser.parse_args(argv)
    homes = [tempfile.TemporaryDirectory() for _ in range(3)]
    for home in homes:
        populate(Path(home.name), SESSIONS)
    store_rate = store_only(Path(homes[0].name), args.turns)
    serial = asyncio.run(through_gateway(Path(homes[1].name), args.turns, concurrent=False))
    busy = asyncio.run(through_gateway(Path(homes[2].name), args.turns, concurrent=True))
    for home in homes:
        home.cleanup()
    store_cost = 1e6 / store_rate
    print(f"SQLite (WAL, synchronous=normal), {SESSIONS:,} sessions, turns over {LANES} lanes")
    print(f"{'store only (TurnPipeline)':42}: {store_rate:7,.0f} turns/s {store_cost:6.0f} us/turn")
    for label, rate in (("Gateway.handle_message, all lanes at once", busy),
                        ("Gateway.handle_message, one turn at a time", serial)):  # fmt: skip
        cost = 1e6 / rate
        print(f"{label:42}: {rate:7,.0f} turns/s {cost:6.0f} us/turn "
              f"({cost / store_cost - 1:+.0%} on the store)")  # fmt: skip
    print("target: the runtime adds at most +50% on top of the store's cost per turn")


if __name__ == "__main__":
    main()
