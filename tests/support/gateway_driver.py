"""The real ``Gateway`` behind a platform simulated in files, for the crash suite and campaign.

Child: ``python gateway_driver.py WORKDIR MODE [SEED]`` with ``HERMES_HOME`` (and optionally
``HERMES_CRASH_AT``) set; the settings come from ``$HERMES_HOME/config.yaml``. WORKDIR holds the
platform: ``inbox.jsonl`` (``MessageEvent.to_dict()`` per line; what was not acknowledged is
delivered again at every start), ``acks.jsonl`` (event ids, appended once ``handle_message``
returned), ``outbox.jsonl`` (what reached the chats, appended before ``send`` reports success)
and ``started.jsonl`` (a line each time ``gateway.start()`` returned). Modes:

- ``run``: hand over the unacknowledged events in order (turns think 0.1 s to 0.5 s, by chat),
  wait until idle, stop;
- ``recover``: start (recovery, ledger sweep, resumed turns), wait until idle, stop; nothing is
  delivered;
- ``drain``: like ``run`` for all but the last event; the last one's turn thinks for a minute and
  the stop's drain (``agent.restart_drain_timeout``) times out;
- ``serve``: hand over the events with small random gaps, turns think a small random time;
- ``graceful``: like ``serve``, but as a random turn's reply comes back from the agent (or once
  everything is answered) stop taking events and stop the gateway while that turn finishes;
- ``ackkill-before``, ``ackkill-after``: like ``run`` (turns think ``ACKKILL_THINK``, so an earlier
  event's turn is still running), but the last event's ``handle_message`` return is followed by a
  SIGKILL of the child, before or after its acknowledgement is appended.

Parent: the helpers below write the inbox and the settings, run :func:`child` in a child process
(forked from a server that imported the gateway once, so a restart costs no imports) with a bound
on its time, and check the promises on the store and the platform's files afterwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import multiprocessing.process
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_core import (
    GatewayConfig,
    MessageEvent,
    SessionEntry,
    SessionSource,
    create_plugin_manager,
)
from hermes_core.domain.errors import MessageNotStoredError
from hermes_core.gateway.agents import EchoAgent, TurnRequest
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.turns.ledger import RESTART_PREFIX, SendResult

RUN_THINK = 0.1
"""Seconds a turn of chat 1 thinks in ``run`` and ``drain`` mode once every pending message was
handed over (so its next message arrives while it is busy, however slowly the store commits
under load); chat ``n > 1`` thinks ``RUN_STAGGER * n``, so lanes reach each crash point in chat
order, chat 1 first while the others are still thinking."""
RUN_STAGGER = 0.15
SLOW_THINK = 60.0
ACKKILL_THINK = 2.0
"""Seconds every turn thinks in the ``ackkill-*`` modes: the kill comes while they run."""
SERVE_THINK = 0.08
SERVE_GAP = 0.03
NOTE = "[System note"

# -- the platform's files ---------------------------------------------------------------------


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line durably (the platform never forgets what it saw)."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def acked_ids(workdir: Path) -> set[str]:
    return {str(record["event_id"]) for record in read_lines(workdir / "acks.jsonl")}


# -- the child ---------------------------------------------------------------------------------


class FileAdapter:
    """The telegram connection: every text sent is in the outbox before the send succeeds."""

    platform = "telegram"

    def __init__(self, outbox: Path) -> None:
        self.outbox = outbox

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        record = {"chat": source.chat_id, "thread": source.thread_id, "text": text,
                  "reply_to": reply_to}  # fmt: skip
        append_line(self.outbox, record)
        return SendResult(ok=True)


class ThinkingAgent(EchoAgent):
    """The echo agent, thinking as long as ``think()`` says at each turn; ``answered()`` runs
    as each turn's reply is handed back to the gateway."""

    def __init__(
        self,
        think: Callable[[], float],
        answered: Callable[[], None],
        ready: asyncio.Event | None = None,
    ) -> None:
        super().__init__()
        self.think = think
        self.answered = answered
        self.ready = ready

    async def run_turn(self, request: TurnRequest) -> str | None:
        if self.ready is not None:  # thinking starts once ``ready`` is set
            await self.ready.wait()
        self.delay = self.think()
        reply = await super().run_turn(request)
        self.answered()
        return reply


async def _hand_over(
    gateway: Gateway, event: MessageEvent, acks: Path, kill: str | None = None
) -> None:
    """Deliver one event; acknowledge it once ``handle_message`` returned (a redelivery of a
    stored message returns too). Any other exception ends the child with its traceback.
    ``kill``: SIGKILL the child as soon as ``handle_message`` returned, ``before`` or ``after``
    the acknowledgement."""
    try:
        await gateway.handle_message(event)
    except MessageNotStoredError as exc:
        print(f"not acknowledged {event.event_id}: {exc!r}", file=sys.stderr, flush=True)
        return
    if kill == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    append_line(acks, {"event_id": event.event_id})
    if kill == "after":
        os.kill(os.getpid(), signal.SIGKILL)


async def child(workdir: Path, mode: str, seed: int) -> None:
    config = GatewayConfig.load()
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    rng = random.Random(seed)
    slow = [0.0]
    serving = mode in ("serve", "graceful")
    ack_kill = mode.removeprefix("ackkill-") if mode.startswith("ackkill-") else None
    if ack_kill is not None:
        slow[0] = ACKKILL_THINK
    stopping = asyncio.Event()
    fed = asyncio.Event()  # every pending message was handed over (set during start-up)
    fed.set()
    answers = [0, rng.randint(1, 6)]  # turns answered; the one whose answer stops (graceful)

    def answered() -> None:
        answers[0] += 1
        if mode == "graceful" and answers[0] >= answers[1]:
            stopping.set()  # the stop begins while this turn stores and sends its reply

    def agents(entry: SessionEntry) -> ThinkingAgent:
        chat = entry.origin.chat_id if entry.origin is not None else ""
        number = int(chat) if chat.isdigit() else 1
        pace = RUN_THINK if number <= 1 else RUN_STAGGER * number
        paced = not serving and ack_kill is None and number <= 1

        def thinking() -> float:
            return rng.uniform(0, SERVE_THINK) if serving else slow[0] or pace

        return ThinkingAgent(thinking, answered, fed if paced else None)

    gateway = Gateway(config, plugins, agents, [FileAdapter(workdir / "outbox.jsonl")])
    await gateway.start()
    append_line(workdir / "started.jsonl", {"pid": os.getpid(), "mode": mode})
    acks = workdir / "acks.jsonl"
    acked = acked_ids(workdir)
    pending = [
        MessageEvent.from_dict(record, plugins=plugins)
        for record in read_lines(workdir / "inbox.jsonl")
        if str(record["event_id"]) not in acked
    ]
    if mode == "recover":
        pending = []
    last = pending.pop() if mode == "drain" and pending else None
    target = pending[-1] if ack_kill is not None and pending else None

    async def feed() -> None:
        try:
            for item in pending:
                if stopping.is_set():
                    return
                await _hand_over(gateway, item, acks, ack_kill if item is target else None)
                if serving:
                    await asyncio.sleep(rng.uniform(0, SERVE_GAP))
        finally:
            fed.set()

    async def settle() -> None:
        await feeder
        await gateway.idle()

    fed.clear()  # the turns start() resumed did not wait; the turns begun from here on do
    feeder = asyncio.ensure_future(feed())
    settled = asyncio.ensure_future(settle())
    if mode == "graceful":  # a SIGTERM: the platform connection closes, then the gateway stops
        trigger = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([settled, trigger], return_when=asyncio.FIRST_COMPLETED)
        stopping.set()
        await trigger
        await feeder
    else:
        await settled
    if last is not None:
        slow[0] = SLOW_THINK
        await _hand_over(gateway, last, acks)
    await gateway.stop()
    await settled


# -- the parent --------------------------------------------------------------------------------

CHILD_TIMEOUT = 30.0


def event(chat: str, text: str, message_id: str) -> MessageEvent:
    """A telegram DM event (one lane per chat)."""
    source = SessionSource(platform="telegram", chat_id=chat, user_id=f"u{chat}")
    return MessageEvent(source=source, text=text, message_id=message_id)


def deliver(workdir: Path, events: Iterable[MessageEvent]) -> None:
    """New messages reach the platform (appended to the inbox)."""
    for item in events:
        append_line(workdir / "inbox.jsonl", item.to_dict())


def configure(home: Path, url: str | None, *, drain_timeout: float = 0.5) -> None:
    """``config.yaml``: queue behind busy lanes (no merging, no busy acknowledgements)."""
    settings: dict[str, Any] = {
        "display": {"busy_input_mode": "queue"},
        "gateway": {"busy_ack_enabled": False, "busy_queue": {"burst_window_secs": 0}},
        "agent": {"restart_drain_timeout": drain_timeout},
    }
    if url:
        settings["storage"] = {"url": url}
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    (home / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")


FORKS = multiprocessing.get_context("forkserver")
"""Children fork from a server that imported the gateway once (a start costs no imports)."""
FORKS.set_forkserver_preload([__name__, "hermes_plugins.sql_store.backend", "psycopg",
                              "sqlalchemy.dialects.postgresql.psycopg"])  # fmt: skip


def _forked(workdir: str, mode: str, seed: int, environ: dict[str, str], log: str) -> None:
    """A forked child: the given environment, output to ``log``, then :func:`child`."""
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ.clear()
    os.environ.update(environ)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    asyncio.run(child(Path(workdir), mode, seed))


@dataclass
class Child:
    """One child gateway process; its output goes to a log file in the workdir."""

    process: multiprocessing.process.BaseProcess
    log: Path
    label: str

    def started(self, workdir: Path, before: int) -> bool:
        return len(read_lines(workdir / "started.jsonl")) > before

    def running(self) -> bool:
        return self.process.is_alive()

    def ended_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the child to end on its own (returns as soon as it does)."""
        self.process.join(seconds)
        return not self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    def wait(self, timeout: float = CHILD_TIMEOUT) -> int:
        """The exit code: 0 or -SIGKILL; anything else (or a hang) fails with the child's log."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            self.process.join()
            raise AssertionError(f"{self.label} hung for {timeout} s:\n{self.output()}")
        code = self.process.exitcode
        if code not in (0, -signal.SIGKILL):
            raise AssertionError(f"{self.label} failed ({code}):\n{self.output()}")
        return code

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-6000:]


def spawn(
    workdir: Path, home: Path, mode: str, crash_at: str | None = None, seed: int = 0
) -> Child:
    """Start a child gateway (``HERMES_HOME=home``, SIGKILL at ``crash_at`` if given)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    environ["HERMES_HOME"] = str(home)
    if crash_at:
        environ["HERMES_CRASH_AT"] = crash_at
    runs = len(list(workdir.glob("child-*.log")))
    log = workdir / f"child-{runs:03d}-{mode}-{crash_at or 'none'}.log"
    log.touch()
    process = FORKS.Process(target=_forked, args=(str(workdir), mode, seed, environ, str(log)))
    process.start()
    return Child(process, log, f"driver {mode} (crash at {crash_at}, seed {seed})")


def run(workdir: Path, home: Path, mode: str, crash_at: str | None = None, seed: int = 0) -> int:
    """Run the child to its end: 0, or -SIGKILL when it reached ``crash_at``."""
    return spawn(workdir, home, mode, crash_at, seed).wait()


def open_store(home: Path) -> SessionStore:
    """The gateway's store (its ``config.yaml``), for checks after the gateway stopped."""
    config = GatewayConfig.load(environ={"HERMES_HOME": str(home)})
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    return SessionStore.open(config, plugins=plugins)


@dataclass
class Tally:
    """The promises, counted after the last clean run."""

    events: int = 0
    acked: int = 0
    lost: int = 0
    unanswered: int = 0
    plain_twice: int = 0
    marked_twice: int = 0
    duplicates: int = 0
    """Deliveries beyond the first, per message."""
    stored_twice: int = 0
    notes: int = 0
    resumed_twice: int = 0
    """Resume notes after the interrupted turn had been answered, or more than one per
    interruption."""
    unfinished_lanes: int = 0
    other_deliveries: int = 0
    problems: list[str] = field(default_factory=list)
    """Broken promises, one line each."""
    others: list[str] = field(default_factory=list)
    """Sent texts that answer no message (notices), for the report."""

    def summary(self) -> str:
        return (
            f"events={self.events} acked={self.acked} lost={self.lost} "
            f"unanswered={self.unanswered} plain_twice={self.plain_twice} "
            f"marked_twice={self.marked_twice} duplicates={self.duplicates} "
            f"stored_twice={self.stored_twice} notes={self.notes} "
            f"resumed_twice={self.resumed_twice} unfinished_lanes={self.unfinished_lanes} "
            f"other_deliveries={self.other_deliveries}"
        )

    def report(self) -> str:
        lines = [self.summary(), *(f"  - {problem}" for problem in self.problems)]
        if self.others:
            lines.append(f"  other texts sent: {self.others[:5]!r}")
        return "\n".join(lines)


def answer_counts(workdir: Path, item: MessageEvent) -> tuple[int, int]:
    """How often the outbox answers ``item``: (plain, marked with the restart prefix)."""
    marker = f"{RESTART_PREFIX}\n\n"
    plain = marked = 0
    for sent in read_lines(workdir / "outbox.jsonl"):
        text = str(sent["text"])
        if sent["chat"] == item.source.chat_id and _answers(text.removeprefix(marker), item):
            marked += text.startswith(marker)
            plain += not text.startswith(marker)
    return plain, marked


def _answers(text: str, event: MessageEvent) -> bool:
    """Whether a sent text (restart prefix removed) is the echo agent's answer to ``event``;
    a resumed lane's next turn may carry the resume note before the message."""
    if not text.startswith("echo: "):
        return False
    body = text[len("echo: ") :]
    return body == event.text or (body.startswith(NOTE) and body.endswith(f"\n\n{event.text}"))


def check_promises(
    workdir: Path, home: Path, events: Sequence[MessageEvent], interruptions: int | None
) -> Tally:
    """Count the crash-suite promises over every lane of ``events``.

    ``interruptions``: how many runs were killed or drained with a turn cut short, the most resume
    notes a lane may show (None: not known; then only notes after an answered turn count).
    """
    tally = Tally(events=len(events))
    acked = acked_ids(workdir)
    tally.acked = len(acked & {item.event_id for item in events})
    deliveries = read_lines(workdir / "outbox.jsonl")
    marker = f"{RESTART_PREFIX}\n\n"
    matched: set[int] = set()
    for item in events:
        plain = marked = 0
        for number, sent in enumerate(deliveries):
            text = str(sent["text"])
            is_marked = text.startswith(marker)
            if sent["chat"] != item.source.chat_id:
                continue
            if not _answers(text.removeprefix(marker), item):
                continue
            matched.add(number)
            marked += is_marked
            plain += not is_marked
        where = f"{item.text!r} (chat {item.source.chat_id})"
        if plain + marked == 0:
            tally.unanswered += 1
            tally.problems.append(f"{where} was never answered")
        if plain > 1:
            tally.plain_twice += 1
            tally.problems.append(f"{where} was delivered plainly {plain} times")
        if marked > 1:
            tally.marked_twice += 1
            tally.problems.append(f"{where} was re-sent with the restart prefix {marked} times")
        tally.duplicates += max(0, plain + marked - 1)
    tally.others = [str(sent["text"]) for n, sent in enumerate(deliveries) if n not in matched]
    tally.other_deliveries = len(tally.others)
    with open_store(home) as store:
        keys = {store.session_key_for(item.source) for item in events}
        for key in sorted(keys):
            _check_lane(store, key, events, acked, interruptions, tally)
    if tally.acked != len(events):
        tally.problems.append(f"only {tally.acked} of {len(events)} events were acknowledged")
    return tally


def _check_lane(
    store: SessionStore,
    key: str,
    events: Sequence[MessageEvent],
    acked: set[str],
    interruptions: int | None,
    tally: Tally,
) -> None:
    entry = store.lookup_by_session_key(key)
    if entry is None:
        tally.problems.append(f"{key} has no session")
        tally.lost += sum(1 for e in events if e.event_id in acked and _lane(store, e) == key)
        return
    if entry.resume_pending or entry.active_turn_token is not None:
        tally.unfinished_lanes += 1
        tally.problems.append(
            f"{key} left resume_pending={entry.resume_pending} ({entry.resume_reason}), "
            f"active_turn_token={entry.active_turn_token}"
        )
    if entry.suspended or entry.auto_reset_reason == "suspended":
        tally.problems.append(f"{key} was suspended as a stuck loop")
    transcript = store.load_transcript(entry.session_id)
    stored = Counter(
        str(m["platform_message_id"])
        for m in transcript
        if m.get("role") == "user" and m.get("platform_message_id")
    )
    for item in events:
        if _lane(store, item) != key:
            continue
        if item.event_id in acked and stored[str(item.message_id)] == 0:
            tally.lost += 1
            tally.problems.append(f"acknowledged {item.text!r} is not in {key}'s transcript")
        if stored[str(item.message_id)] > 1:
            tally.stored_twice += 1
            tally.problems.append(
                f"{item.text!r} is stored {stored[str(item.message_id)]} times in {key}"
            )
    visible = [m for m in transcript if m.get("role") in ("user", "assistant")]
    notes = 0
    for number, message in enumerate(visible):
        if message.get("role") != "user" or not str(message.get("content", "")).startswith(NOTE):
            continue
        notes += 1
        previous = visible[number - 1] if number else None
        if previous is not None and previous.get("role") == "assistant":
            tally.resumed_twice += 1
            tally.problems.append(
                f"{key}: a turn already answered ({str(previous.get('content'))!r}) was resumed "
                f"again: {str(message.get('content'))[:90]!r}"
            )
    tally.notes += notes
    if interruptions is not None and notes > interruptions:
        tally.resumed_twice += 1
        tally.problems.append(f"{key} shows {notes} resume notes for {interruptions} interruptions")


def _lane(store: SessionStore, item: MessageEvent) -> str:
    return store.session_key_for(item.source)


def wait_started(child: Child, workdir: Path, before: int, deadline: float) -> bool:
    """Wait until the child's ``gateway.start()`` returned; False if it exited or time ran out."""
    while time.monotonic() < deadline:
        if child.started(workdir, before):
            return True
        if not child.running():
            return False
        time.sleep(0.01)
    return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(child(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if sys.argv[3:] else 0))
