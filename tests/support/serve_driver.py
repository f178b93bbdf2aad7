"""A gateway process that serves until a signal, for the ``Gateway.serve`` tests.

Usage: ``python serve_driver.py WORKDIR THINK_SECS`` with ``HERMES_HOME`` set. It starts a
gateway (``async with``), hands it one message whose turn thinks for ``THINK_SECS`` (and cannot
be interrupted), writes ``WORKDIR/ready``, then serves until SIGINT or SIGTERM. Replies are
appended to ``WORKDIR/outbox.jsonl``; the exit status is 0 when the drain finished, else 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

from hermes_core import (
    Agent,
    Gateway,
    GatewayConfig,
    InMemoryAdapter,
    MessageEvent,
    SendResult,
    SessionSource,
    TurnRequest,
    create_plugin_manager,
)


class SlowAgent(Agent):
    """Thinks for a while, then echoes; keeps the base class's defaults."""

    def __init__(self, think: float) -> None:
        self.think = think

    async def run_turn(self, request: TurnRequest) -> str | None:
        await asyncio.sleep(self.think)
        return f"done: {request.message}"


class FileAdapter(InMemoryAdapter):
    """Appends every sent text to the outbox."""

    def __init__(self, outbox: Path) -> None:
        super().__init__(platform="telegram")
        self.outbox = outbox

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        with self.outbox.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"chat": source.chat_id, "text": text}) + "\n")
        return SendResult(ok=True)


async def main(workdir: Path, think: float) -> bool:
    config = GatewayConfig.load()
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    adapter = FileAdapter(workdir / "outbox.jsonl")
    async with Gateway(config, plugins, lambda entry: SlowAgent(think), [adapter]) as gateway:
        source = SessionSource(platform="telegram", chat_id="7", user_id="ana")
        await gateway.handle_message(MessageEvent(source=source, text="hello"))
        # Ready once serve() has installed its signal handlers (when it first waits).
        asyncio.get_running_loop().call_soon((workdir / "ready").touch)
        return await gateway.serve()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2]))) else 1)
