"""Several real ``Gateway`` processes sharing one PostgreSQL database (``storage.instances:
shared``), for the multi-process tests.

Child ``shared_child(home, url, workdir, name, events)``: a gateway whose agent records each
turn's start and end (monotonic clock of the host, lane key) in ``spans-<name>.jsonl``; it hands
over its events with small gaps, then keeps serving until every reply the test expects is in
the outboxes of all children, and stops.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from hermes_core import GatewayConfig, MessageEvent, SessionEntry, SessionSource
from hermes_core.agents import EchoAgent, TurnRequest
from hermes_core.ledger import SendResult
from hermes_core.runtime import Gateway
from support.gateway_driver import append_line, read_lines

SPAWN = multiprocessing.get_context("spawn")


class OutboxAdapter:
    """Replies go to this child's outbox file."""

    platform = "telegram"

    def __init__(self, outbox: Path) -> None:
        self.outbox = outbox

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        append_line(self.outbox, {"chat": source.chat_id, "text": text, "reply_to": reply_to})
        return SendResult(ok=True)


class SpanAgent(EchoAgent):
    """Echo after ``think`` seconds, recording the turn's span for the harness."""

    def __init__(self, spans: Path, think: float) -> None:
        super().__init__()
        self.spans = spans
        self.delay = think

    async def run_turn(self, request: TurnRequest) -> str | None:
        started = time.time()
        reply = await super().run_turn(request)
        append_line(self.spans, {"key": request.session_key, "start": started, "end": time.time()})
        return reply


def configure(home: Path, url: str, *, lease_secs: float = 4.0) -> GatewayConfig:
    settings: dict[str, Any] = {
        "display": {"busy_input_mode": "queue"},
        "gateway": {"busy_ack_enabled": False, "busy_queue": {"burst_window_secs": 0}},
        "agent": {"restart_drain_timeout": 5},
        "storage": {"url": url, "instances": "shared", "turn_lease_secs": lease_secs,
                    "lease_scan_secs": 0.5},
    }  # fmt: skip
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    (home / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")
    return GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(home)})


def event(chat: str, text: str, message_id: str) -> dict[str, Any]:
    source = SessionSource(platform="telegram", chat_id=chat, chat_type="dm", user_id=chat)
    return MessageEvent(text=text, source=source, message_id=message_id).to_dict()


def replies(workdir: Path) -> list[dict[str, Any]]:
    """Every reply any child sent."""
    return [line for path in sorted(workdir.glob("outbox-*.jsonl")) for line in read_lines(path)]


async def _serve(
    home: Path, workdir: Path, name: str, events: list[dict[str, Any]], expected: int,
    think: float,
) -> None:  # fmt: skip
    config = GatewayConfig.from_dict(
        json.loads((home / "config.yaml").read_text()), environ={"HERMES_HOME": str(home)}
    )
    spans = workdir / f"spans-{name}.jsonl"

    def agents(entry: SessionEntry) -> SpanAgent:
        return SpanAgent(spans, think)

    gateway = Gateway(config, None, agents, [OutboxAdapter(workdir / f"outbox-{name}.jsonl")])
    await gateway.start()
    append_line(workdir / "started.jsonl", {"name": name})
    for item in events:
        await gateway.handle_message(MessageEvent.from_dict(item))
        append_line(workdir / f"acks-{name}.jsonl", {"id": item["message_id"]})
        await asyncio.sleep(0.02)
    deadline = time.monotonic() + 60
    while len(replies(workdir)) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await gateway.idle()
    await gateway.stop()


def shared_child(
    home: str, workdir: str, name: str, events: list[dict[str, Any]], expected: int,
    think: float = 0.2,
) -> None:  # fmt: skip
    """A child process's body (see the module docstring)."""
    asyncio.run(_serve(Path(home), Path(workdir), name, events, expected, think))
