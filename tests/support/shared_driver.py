"""Several real ``Gateway`` processes sharing one PostgreSQL database (``storage.instances:
shared``), for the multi-process tests.

Child ``shared_child(home, url, workdir, name, events)``: a gateway whose agent records each
turn's start and end (monotonic clock of the host, lane key) in ``spans-<name>.jsonl``; it hands
over its events with small gaps, then keeps serving until every reply the test expects is in
the outboxes of all children, and stops.

:class:`Fleet`: named children that can be started, SIGKILLed, stopped cleanly and restarted
(same ``$HERMES_HOME``, so the same instance id, with a new boot), each fed through
``inbox-<name>.jsonl`` (what it did not acknowledge in ``acks-<name>.jsonl`` is handed over
again when it restarts), logging each turn's start and end in ``turns-<name>.jsonl`` and each
reply in ``outbox-<name>.jsonl``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hermes_core import GatewayConfig, MessageEvent, SessionEntry, SessionSource
from hermes_core.domain.errors import MessageNotStoredError
from hermes_core.gateway.agents import EchoAgent, TurnRequest
from hermes_core.gateway.leased import LeasedOwnership
from hermes_core.gateway.runtime import Gateway
from hermes_core.state.instance import instance_id
from hermes_core.turns.ledger import RESTART_PREFIX, TAKEOVER_PREFIX, SendResult
from hermes_core.turns.queue import EnqueueResult
from support.gateway_driver import FORKS, append_line, read_lines

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
        record = {"chat": source.chat_id, "text": text, "reply_to": reply_to, "t": time.time(),
                  "pid": os.getpid()}  # fmt: skip
        append_line(self.outbox, record)
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


def leased(gateway: Gateway) -> LeasedOwnership:
    """The lane ownership of a started gateway on a shared store."""
    parts = gateway._parts
    assert parts is not None
    assert isinstance(parts.ownership, LeasedOwnership)
    return parts.ownership


def configure(
    home: Path, url: str, *, lease_secs: float = 4.0, scan_secs: float = 0.5
) -> GatewayConfig:
    settings: dict[str, Any] = {
        "display": {"busy_input_mode": "queue"},
        "gateway": {"busy_ack_enabled": False, "busy_queue": {"burst_window_secs": 0}},
        "agent": {"restart_drain_timeout": 5},
        "storage": {"url": url, "instances": "shared", "turn_lease_secs": lease_secs,
                    "lease_scan_secs": scan_secs},
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


# -- a fleet of restartable children fed through inbox files ----------------------------------


class TurnLog(EchoAgent):
    """Echo after a random think time, logging each turn's start and end (event id, whether it
    is an internal resume, session, process, wall clock; ``for``: the message the turn answers,
    for a resume the last human message of the history; at the end the reply) in
    ``turns-<name>.jsonl``. A ``stubborn`` agent ends the step it is in before it honours an
    interruption (as one waiting for a tool call in a thread would): the turn stops only once
    its think time is over."""

    def __init__(
        self, log: Path, think: tuple[float, float], rng: random.Random, stubborn: bool = False
    ) -> None:
        super().__init__()
        self.log = log
        self.think = think
        self.rng = rng
        self.stubborn = stubborn

    async def run_turn(self, request: TurnRequest) -> str | None:
        answers = request.event.message_id
        if request.event.internal:
            human = [m for m in await request.history()
                     if m.get("role") == "user" and m.get("display_kind") is None]  # fmt: skip
            answers = human[-1].get("platform_message_id") if human else None
        record = {"key": request.session_key, "id": request.event.message_id, "for": answers,
                  "resume": request.event.internal, "session": request.session_id,
                  "pid": os.getpid()}  # fmt: skip
        append_line(self.log, {**record, "kind": "start", "t": time.time()})
        self.delay = self.rng.uniform(*self.think)
        work = asyncio.ensure_future(super().run_turn(request))
        try:
            reply = await (asyncio.shield(work) if self.stubborn else work)
        except asyncio.CancelledError:
            await work
            raise
        append_line(self.log, {**record, "kind": "end", "t": time.time(), "reply": reply})
        return reply


class Inbox:
    """The platform's side of one child: the events written to ``inbox-<name>.jsonl`` that were
    not acknowledged in ``acks-<name>.jsonl`` (read as the file grows)."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.path = workdir / f"inbox-{name}.jsonl"
        self.acks = workdir / f"acks-{name}.jsonl"
        self.offset = 0
        self.done = {str(line["id"]) for line in read_lines(self.acks)}
        self.waiting: list[MessageEvent] = []

    def poll(self) -> list[MessageEvent]:
        """The unacknowledged events, new ones appended (only whole lines are read)."""
        if self.path.exists():
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(whole)
            for line in whole.decode("utf-8").splitlines():
                item = MessageEvent.from_dict(json.loads(line))
                if str(item.message_id) not in self.done:
                    self.waiting.append(item)
        return list(self.waiting)

    def ack(self, item: MessageEvent) -> None:
        append_line(self.acks, {"id": item.message_id, "t": time.time()})
        self.done.add(str(item.message_id))
        self.waiting.remove(item)


async def _serve_inbox(
    home: Path, workdir: Path, name: str, think: tuple[float, float], seed: int, stubborn: bool
) -> None:
    config = GatewayConfig.from_dict(
        json.loads((home / "config.yaml").read_text()), environ={"HERMES_HOME": str(home)}
    )
    rng = random.Random(seed)
    log = workdir / f"turns-{name}.jsonl"

    def agents(entry: SessionEntry) -> TurnLog:
        return TurnLog(log, think, rng, stubborn)

    gateway = Gateway(config, None, agents, [OutboxAdapter(workdir / f"outbox-{name}.jsonl")])
    await gateway.start()
    append_line(workdir / "started.jsonl", {"name": name, "pid": os.getpid(), "t": time.time()})
    inbox = Inbox(workdir, name)
    stop, freeze = workdir / f"stop-{name}", workdir / f"freeze-{name}"
    queueing = workdir / f"freeze-queueing-{name}"
    while not stop.exists():
        if freeze.exists():
            freeze.unlink()
            held = gateway.store._leases.held_lanes()
            await gateway.store.arun(_freeze, gateway, workdir, name, lane=held[0] if held else "")
        items = inbox.poll()
        target = queueing.read_text() if queueing.exists() else None  # read after the poll
        for item in items:
            try:
                if str(item.message_id) == target:
                    queueing.unlink()
                    key = gateway.store.session_key_for(item.source)
                    runs: list[bool] = []
                    await gateway.store.arun(
                        _queue_frozen, gateway, workdir, name, key, item, runs, lane=key
                    )
                else:
                    await gateway.handle_message(item)
            except (MessageNotStoredError, FrozenStepLost):
                continue  # not acknowledged: handed over again at the next poll
            inbox.ack(item)
        await asyncio.sleep(0.02)
    await gateway.stop()
    append_line(workdir / "stopped.jsonl", {"name": name, "pid": os.getpid(), "t": time.time()})


def _freeze(gateway: Gateway, workdir: Path, name: str) -> None:
    """Writer step: take the held lanes' leases again (each grant locks the lane's lease row
    until the transaction ends), then say so in ``frozen.jsonl`` (naming the lanes) and wait
    with that transaction open, for the harness to stop the process (SIGSTOP) as a host freeze
    would."""
    store = gateway.store
    held = store._leases.held_lanes()
    for key in held:
        store._leases.take_lease(key)
    append_line(workdir / "frozen.jsonl", {"name": name, "pid": os.getpid(), "lanes": held,
                                           "t": time.time()})  # fmt: skip
    time.sleep(60)  # Fleet.freeze stops the process here


class FrozenStepLost(Exception):
    """The frozen step's transaction was ended while the process was stopped."""


def _queue_frozen(
    gateway: Gateway, workdir: Path, name: str, key: str, item: MessageEvent, runs: list[bool]
) -> None:
    """Writer step: what ``handle_message`` does with a message for a lane another process
    holds (``LeasedOwnership``'s open step: the refused grant marks the lane's lease row, locked
    until the transaction ends, and the message is queued durably), then say so in
    ``frozen.jsonl`` and wait with that transaction open, stopped by the harness (SIGSTOP),
    until ``thaw-<name>`` exists. Run again because the batch was rolled back (the database
    ended the frozen transaction), it raises: the message is handed over again."""
    if runs:
        raise FrozenStepLost(f"the frozen transaction that queued {item.message_id} was ended")
    runs.append(True)
    assert gateway.pipeline is not None
    queued, _ = leased(gateway)._open_step(key, item, gateway.pipeline.begin)
    append_line(workdir / "frozen.jsonl", {"name": name, "pid": os.getpid(), "lanes": [key],
                                           "queued": isinstance(queued, EnqueueResult),
                                           "t": time.time()})  # fmt: skip
    thaw = workdir / f"thaw-{name}"
    while not thaw.exists():  # Fleet.freeze_queueing stops the process here
        time.sleep(0.05)
    thaw.unlink()


def inbox_child(
    home: str, workdir: str, name: str, think: tuple[float, float], seed: int, log: str,
    stubborn: bool,
) -> None:  # fmt: skip
    """A fleet child's body: serve ``inbox-<name>.jsonl`` until ``stop-<name>`` exists."""
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(output, 1)
    os.dup2(output, 2)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    asyncio.run(_serve_inbox(Path(home), Path(workdir), name, think, seed, stubborn))


class Fleet:
    """Gateway processes on one shared database, each named, with its own ``$HERMES_HOME``
    (``home-<name>``, so its own instance id that survives its restarts) and inbox."""

    def __init__(
        self, root: Path, url: str, *, lease_secs: float = 4.0, scan_secs: float = 0.5,
        think: tuple[float, float] = (0.05, 0.2), stubborn: bool = False,
    ) -> None:  # fmt: skip
        self.root = root
        self.url = url
        self.lease_secs = lease_secs
        self.scan_secs = scan_secs
        self.think = think
        self.stubborn = stubborn
        """Turns end their step before they honour an interruption (see :class:`TurnLog`)."""
        self.workdir = root / "work"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, multiprocessing.process.BaseProcess] = {}
        self.runs = 0

    def home(self, name: str) -> Path:
        return self.root / f"home-{name}"

    def instance(self, name: str) -> str:
        """The child's instance id (the lease owner it writes)."""
        return instance_id(self.home(name))

    def start(self, name: str, *, wait: bool = True) -> None:
        """Start (or restart) the child; with ``wait``, until its gateway has started."""
        home = self.home(name)
        if not home.exists():
            configure(home, self.url, lease_secs=self.lease_secs, scan_secs=self.scan_secs)
        (self.workdir / f"stop-{name}").unlink(missing_ok=True)
        before = self.started(name)
        self.runs += 1
        log = self.workdir / f"child-{name}-{self.runs:03d}.log"
        process = FORKS.Process(
            target=inbox_child,
            args=(
                str(home),
                str(self.workdir),
                name,
                self.think,
                self.runs,
                str(log),
                self.stubborn,
            ),
        )
        process.start()
        self.children[name] = process
        if wait:
            self.wait_for(lambda: self.started(name) > before, f"{name} to start", 60)

    def started(self, name: str) -> int:
        return sum(1 for line in read_lines(self.workdir / "started.jsonl") if line["name"] == name)

    def alive(self, name: str) -> bool:
        process = self.children.get(name)
        return process is not None and process.is_alive()

    def kill(self, name: str) -> None:
        """SIGKILL the child and wait until it is gone."""
        process = self.children[name]
        process.kill()
        process.join(10)

    def freeze(self, name: str) -> list[str]:
        """Make the child stop itself (SIGSTOP) inside an open writer transaction that holds
        the lease rows of the lanes it holds locked; those lanes."""
        return list(self._frozen(name, (self.workdir / f"freeze-{name}").touch)["lanes"])

    def freeze_queueing(self, name: str, item: dict[str, Any]) -> dict[str, Any]:
        """Hand ``item`` to the child, which queues it (see ``_queue_frozen``) and stops
        (SIGSTOP) right after, inside the open writer transaction; its ``frozen.jsonl`` line
        (``queued``: the message was queued, not begun). :meth:`thaw` lets it go on."""

        def ask() -> None:
            (self.workdir / f"freeze-queueing-{name}").write_text(str(item["message_id"]))
            self.deliver(name, [item])

        return self._frozen(name, ask)

    def _frozen(self, name: str, ask: Callable[[], None]) -> dict[str, Any]:
        before = len(read_lines(self.workdir / "frozen.jsonl"))
        ask()
        self.wait_for(lambda: len(read_lines(self.workdir / "frozen.jsonl")) > before, "a freeze")
        pid = self.children[name].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        return dict(read_lines(self.workdir / "frozen.jsonl")[-1])

    def thaw(self, name: str) -> None:
        """Let a child frozen by :meth:`freeze_queueing` go on (SIGCONT)."""
        (self.workdir / f"thaw-{name}").touch()
        pid = self.children[name].pid
        assert pid is not None
        os.kill(pid, signal.SIGCONT)

    def stop(self, name: str, timeout: float = 60) -> None:
        """A clean stop (the gateway drains and stops), then wait for the exit."""
        (self.workdir / f"stop-{name}").touch()
        process = self.children[name]
        process.join(timeout)
        if process.exitcode != 0:
            process.kill()
            raise AssertionError(f"{name} did not stop cleanly ({process.exitcode})")

    def stop_all(self) -> None:
        for name in list(self.children):
            if self.alive(name):
                (self.workdir / f"stop-{name}").touch()
        for name in list(self.children):
            if self.alive(name):
                self.stop(name)

    def deliver(self, name: str, events: list[dict[str, Any]]) -> None:
        """New messages for the child reach the platform."""
        for item in events:
            append_line(self.workdir / f"inbox-{name}.jsonl", item)

    def turns(self) -> list[dict[str, Any]]:
        """Every turn start and end any child logged, each with the child's name."""
        return [
            {**line, "name": path.stem.removeprefix("turns-")}
            for path in sorted(self.workdir.glob("turns-*.jsonl"))
            for line in read_lines(path)
        ]

    def sent(self) -> list[dict[str, Any]]:
        """Every reply any child sent, each with the child's name, in the order sent."""
        sent = [
            {**line, "name": path.stem.removeprefix("outbox-")}
            for path in sorted(self.workdir.glob("outbox-*.jsonl"))
            for line in read_lines(path)
        ]
        return sorted(sent, key=lambda line: float(line["t"]))

    def acked(self) -> set[str]:
        return {str(line["id"]) for path in self.workdir.glob("acks-*.jsonl")
                for line in read_lines(path)}  # fmt: skip

    def answers(self, events: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
        """Per message id of ``events``: how often it was answered plainly and how often marked
        as a possible duplicate. A resumed turn answers the interrupted message without
        replying to it (``reply_to`` empty; the echo names the message)."""
        markers = (f"{RESTART_PREFIX}\n\n", f"{TAKEOVER_PREFIX}\n\n")
        counts: dict[str, list[int]] = {str(item["message_id"]): [0, 0] for item in events}
        texts = {(str(item["source"]["chat_id"]), f"echo: {item['text']}"): str(item["message_id"])
                 for item in events}  # fmt: skip
        for line in self.sent():
            body = str(line["text"])
            marker = next((marker for marker in markers if body.startswith(marker)), "")
            marked = bool(marker)
            reply_to = line["reply_to"] or texts.get((str(line["chat"]), body.removeprefix(marker)))
            if reply_to in counts:
                counts[reply_to][marked] += 1
        return {key: (plain, marked) for key, (plain, marked) in counts.items()}

    def unanswered(self, events: list[dict[str, Any]]) -> list[str]:
        return [key for key, counts in self.answers(events).items() if sum(counts) == 0]

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        return "\n".join(
            f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.workdir.glob("child-*.log"))
            if path.stat().st_size
        )
