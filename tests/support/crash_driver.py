"""A minimal gateway driven by files, for the crash suite (SPEC §7.12).

Usage: ``python crash_driver.py WORKDIR [run|drain]`` with ``HERMES_HOME`` (and optionally
``HERMES_CRASH_AT``) in the environment. The platform is simulated by three JSON-lines files in
WORKDIR: ``inbox.jsonl`` (events the platform delivers until acknowledged), ``acks.jsonl`` (the
platform's record of acknowledged event ids) and ``outbox.jsonl`` (what reached the chat).

``run`` performs the start-up of SPEC §7.2 (recovery steps, ledger boot sweep, auto-resume), then
handles every unacknowledged event and stops gracefully. ``drain`` handles all but the last event,
starts the last one's turn and stops with a drain that times out (SPEC §7.8).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hermes_core import GatewayConfig, MessageEvent, create_plugin_manager
from hermes_core.crashpoints import crash_point
from hermes_core.ledger import SendFunction, SendResult
from hermes_core.pipeline import Turn, TurnPipeline
from hermes_core.recovery import GatewayState
from hermes_core.resume import resume_candidates, resume_event
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation


def append_line(path: Path, record: dict[str, object]) -> None:
    """Append one JSON line durably (the simulated platform never loses what it saw)."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


Agent = Callable[[Turn], str]


def echo_agent(store: SessionStore) -> Agent:
    """Replies ``echo: <the last human message of the session>`` (so a resumed turn answers
    the message it was interrupted on)."""

    def respond(turn: Turn) -> str:
        for message in reversed(store.load_transcript(turn.entry.session_id)):
            if message.get("role") == "user" and message.get("display_kind") is None:
                return f"echo: {message.get('content')}"
        return "echo: (nothing)"

    return respond


def main() -> int:
    workdir = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "run"
    config = GatewayConfig.load()
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    state = GatewayState(config, plugins=plugins)
    store = state.start()
    pipeline = TurnPipeline(store, config)
    outbox, acks = workdir / "outbox.jsonl", workdir / "acks.jsonl"

    def send(row: Obligation, text: str) -> SendResult:
        append_line(outbox, {"session_key": row.session_key, "text": text})
        return SendResult(ok=True)

    agent = echo_agent(store)
    ledger = store.ledger
    if ledger is not None:
        ledger.boot_sweep(["telegram"], send, settled=store.clear_resume_pending)
    window = config.agent.gateway_auto_continue_freshness
    for entry in resume_candidates(store, window):
        pipeline.run(resume_event(entry), agent, send)

    acked = {str(record["event_id"]) for record in read_lines(acks)}
    pending = [
        MessageEvent.from_dict(record, plugins=plugins)
        for record in read_lines(workdir / "inbox.jsonl")
        if str(record["event_id"]) not in acked
    ]
    last = pending.pop() if mode == "drain" and pending else None
    for event in pending:
        handle(event, store, pipeline, agent, send, acks)
    if last is None:
        state.stop(drained=True)
        return 0
    turn = pipeline.begin(last)
    append_line(acks, {"event_id": last.event_id})
    assert turn is not None
    key = turn.entry.session_key
    store.mark_resume_pending(key, "shutdown_timeout")
    crash_point("drain_marked")
    store.mark_resume_pending(key, "shutdown_timeout")  # the wait timed out: still running
    crash_point("drain_timed_out")
    state.stop(drained=False)
    return 0


def handle(
    event: MessageEvent,
    store: SessionStore,
    pipeline: TurnPipeline,
    agent: Agent,
    send: SendFunction,
    acks: Path,
) -> None:
    """One inbound event: skip it if a crash left it stored but unacknowledged (its turn is
    resumed or its reply swept), else run its turn, acknowledging once the message is durable."""
    entry = store.lookup_by_session_key(store.session_key_for(event.source))
    if entry is not None and any(
        m.get("platform_message_id") == event.message_id
        for m in store.load_transcript(entry.session_id)
    ):
        append_line(acks, {"event_id": event.event_id})
        return
    turn = pipeline.begin(event)
    append_line(acks, {"event_id": event.event_id})
    assert turn is not None
    reply = pipeline.finish(turn, agent(turn))
    if reply is not None:
        pipeline.deliver(turn, reply, send)
    pipeline.complete(turn, success=True)


if __name__ == "__main__":
    sys.exit(main())
