"""A gateway streaming one reply into a chat kept in a file, for the streaming crash tests.

Child: ``python stream_driver.py WORKDIR`` with ``HERMES_HOME`` (its ``config.yaml``) and
optionally ``HERMES_CRASH_AT`` set. It starts a gateway whose agent streams :data:`REPLY` in
chunks, over an editing adapter whose messages live in ``WORKDIR/chats.json`` (written before
each post or edit reports success); hands over the message of ``WORKDIR/inbox.json`` unless
``WORKDIR/acked`` exists (created once ``handle_message`` returned); waits until idle; stops.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hermes_core import Gateway, GatewayConfig, MessageEvent, create_plugin_manager
from support.streaming import EditingChats, StreamingAgent

WORDS = [f"word{n:02d} " for n in range(24)]
REPLY = "".join(WORDS)
"""What the agent streams (each chunk after a short pause), in every turn."""


async def child(workdir: Path) -> None:
    config = GatewayConfig.load()
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    chats = EditingChats(path=workdir / "chats.json", message_limit=80)
    agent = StreamingAgent(WORDS, pause=0.01)
    gateway = Gateway(config, plugins, lambda entry: agent, [chats])
    await gateway.start()
    acked = workdir / "acked"
    if not acked.exists():
        event = MessageEvent.from_dict(json.loads((workdir / "inbox.json").read_text()))
        await gateway.handle_message(event)
        acked.touch()
    await gateway.idle()
    await gateway.stop()


if __name__ == "__main__":
    asyncio.run(child(Path(sys.argv[1])))
