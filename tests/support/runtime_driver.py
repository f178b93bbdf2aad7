"""The real ``Gateway`` driven by files, for the queue-durability tests.

Usage: ``python runtime_driver.py WORKDIR fill|run`` with ``HERMES_HOME`` (and optionally
``HERMES_CRASH_AT``) set. ``fill`` starts a turn that thinks for a long time, hands the other
inbox events to the gateway (they queue behind it, durably), acknowledges each once accepted, then
dies by SIGKILL. ``run`` starts the gateway (restoring the queues and resuming the interrupted
turn), hands over unacknowledged events, waits until every lane is idle and stops. Replies are
appended to ``outbox.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from hermes_core import GatewayConfig, MessageEvent, SessionSource, create_plugin_manager
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.turns.ledger import SendResult


class FileAdapter(InMemoryAdapter):
    """Appends every sent text to the outbox, durably."""

    def __init__(self, outbox: Path) -> None:
        super().__init__(platform="telegram")
        self.outbox = outbox

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        with self.outbox.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"chat": source.chat_id, "text": text}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return SendResult(ok=True)


def lines(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


async def main(workdir: Path, mode: str) -> None:
    config = GatewayConfig.load()
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    delay = 60.0 if mode == "fill" else 0.0
    gateway = Gateway(config, plugins, lambda entry: EchoAgent(delay),
                      [FileAdapter(workdir / "outbox.jsonl")])  # fmt: skip
    await gateway.start()
    acks = workdir / "acks.jsonl"
    acked = {record["event_id"] for record in lines(acks)}
    for record in lines(workdir / "inbox.jsonl"):
        if record["event_id"] in acked:
            continue
        await gateway.handle_message(MessageEvent.from_dict(record, plugins=plugins))
        with acks.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"event_id": record["event_id"]}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        await asyncio.sleep(0.05)  # the first turn starts before the others arrive
    if mode == "fill":
        os.kill(os.getpid(), signal.SIGKILL)
    await gateway.idle()
    await gateway.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
