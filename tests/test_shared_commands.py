"""Commands sent through one gateway for a lane whose turn runs in another, on a shared
PostgreSQL store (each gateway stands for a process of its own: its own ``$HERMES_HOME``, so its
own instance id). The holder is woken (``LISTEN``/``NOTIFY``) and carries the command out at
once; without a wake-up it would run only once the turn ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from support.database import run_sql
from test_shared_takeover import Held, _gateway, _wait

from hermes_core import MessageEvent, SessionSource
from hermes_core.gateway.agents import EchoAgent, TurnRequest
from hermes_core.gateway.texts import NEW_SESSION, STOPPED
from hermes_core.store import SessionStore

pytestmark = [pytest.mark.postgres, pytest.mark.multi_process, pytest.mark.slow]

SOURCE = SessionSource(platform="telegram", chat_id="c1", chat_type="dm", user_id="c1")


class Endless(EchoAgent):
    """A turn that never ends by itself (only an interruption ends it)."""

    def __init__(self, started: asyncio.Event) -> None:
        super().__init__()
        self.started = started

    async def run_turn(self, request: TurnRequest) -> str | None:
        self.started.set()
        await asyncio.Event().wait()
        return None


def _queued(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM queued_events")).scalar_one()
    engine.dispose()
    return int(count)


@pytest.mark.parametrize(("command", "answer"), [("/stop", STOPPED), ("/new", NEW_SESSION)])
def test_a_command_through_another_gateway_interrupts_the_turn_running_in_the_holder(
    tmp_path: Path, empty_database: str, command: str, answer: str
) -> None:
    async def scenario() -> tuple[list[str], list[str], float, str, str]:
        started = asyncio.Event()
        holder, held = _gateway(tmp_path, "holder", empty_database, lambda: Endless(started), 10)
        other, elsewhere = _gateway(tmp_path, "other", empty_database, EchoAgent, 10)
        await holder.start()
        await other.start()
        key = holder.store.session_key_for(SOURCE)
        await holder.handle_message(MessageEvent(text="think", source=SOURCE, message_id="m1"))
        await started.wait()
        before = holder.store.peek_session_id(key)
        sent = time.monotonic()
        await other.handle_message(MessageEvent(text=command, source=SOURCE, message_id="m2"))
        await _wait(lambda: answer in held.texts(), f"the holder to answer {command}")
        latency = time.monotonic() - sent
        await holder.idle()
        after = holder.store.peek_session_id(key)
        await other.stop()
        await holder.stop()
        return held.texts(), elsewhere.texts(), latency, str(before), str(after)

    held, elsewhere, latency, before, after = asyncio.run(scenario())
    assert held == [answer]  # carried out by the holder, whose turn it interrupted
    assert elsewhere == []
    assert latency < 5  # at once, not when a lease expires or the turn ends
    assert _queued(empty_database) == 0  # the command was taken out of the queue
    assert (before != after) == (command == "/new")


def test_the_lane_goes_on_after_a_command_carried_out_for_another_gateway(
    tmp_path: Path, empty_database: str
) -> None:
    """After a ``/stop`` carried out for another gateway, the lane goes on: the next message
    is answered (by whichever process then takes the lane)."""

    async def scenario() -> list[str]:
        started = asyncio.Event()
        turns = iter([Endless(started)])
        holder, held = _gateway(
            tmp_path, "holder", empty_database, lambda: next(turns, None) or EchoAgent(), 10
        )
        other, elsewhere = _gateway(tmp_path, "other", empty_database, EchoAgent, 10)
        await holder.start()
        await other.start()
        await holder.handle_message(MessageEvent(text="think", source=SOURCE, message_id="m1"))
        await started.wait()
        await other.handle_message(MessageEvent(text="/stop", source=SOURCE, message_id="m2"))
        await _wait(lambda: STOPPED in held.texts(), "the stop")
        await other.handle_message(MessageEvent(text="again", source=SOURCE, message_id="m3"))
        await _wait(lambda: len(held.texts() + elsewhere.texts()) == 2, "the next turn")
        await other.stop()
        await holder.stop()
        return held.texts() + elsewhere.texts()

    assert asyncio.run(scenario()) == [STOPPED, "echo: again"]


_LISTENING = "FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'"
"""The connections that wait for lane wake-ups."""


def _listeners(url: str) -> int:
    """How many connections wait for lane wake-ups."""
    [(listening,)] = run_sql(url, f"SELECT count(*) {_LISTENING}")
    return int(listening)


def _terminate_listeners(url: str) -> int:
    """End every connection that waits for lane wake-ups (as a server restart would)."""
    [(ended,)] = run_sql(url, f"SELECT count(pg_terminate_backend(pid)) {_LISTENING}")
    return int(ended)


def test_the_holder_listens_again_after_its_listening_connection_was_cut(
    tmp_path: Path, empty_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> list[str]:
        started = asyncio.Event()
        holder, held = _gateway(tmp_path, "holder", empty_database, lambda: Endless(started), 10)
        other, _ = _gateway(tmp_path, "other", empty_database, EchoAgent, 10)
        await holder.start()
        await other.start()
        # Each gateway listens on a thread of its own, which may connect after start returns.
        await _wait(lambda: _listeners(empty_database) == 2, "both gateways to listen")
        assert await asyncio.to_thread(_terminate_listeners, empty_database) == 2
        await holder.handle_message(MessageEvent(text="think", source=SOURCE, message_id="m1"))
        await started.wait()
        await asyncio.sleep(1.5)  # the first pause before listening again is 0.5 s
        await other.handle_message(MessageEvent(text="/stop", source=SOURCE, message_id="m2"))
        await _wait(lambda: STOPPED in held.texts(), "the holder to answer /stop")
        await other.stop()
        await holder.stop()
        return held.texts()

    assert asyncio.run(scenario()) == [STOPPED]
    assert any("listening for lane wake-ups failed" in r.getMessage() for r in caplog.records)


def test_a_reset_another_process_queued_is_carried_out_once_in_its_durable_place(
    tmp_path: Path, empty_database: str, stores: Callable[..., SessionStore]
) -> None:
    """Another process stored a message and ``/new hello there`` for a lane whose turn runs in
    the holder, before the holder's own ``/queue later please`` and plain message; no wake-up
    reaches the holder: it meets them when it reads the lane's durable queue after its turn.
    Everything runs in stored order: the earlier message, the reset (once), its own text first
    in the new session, then the holder's later messages (kept, not discarded by the reset)."""

    async def scenario() -> tuple[list[str], int]:
        release, started = asyncio.Event(), asyncio.Event()
        holder, held = _gateway(tmp_path, "holder", empty_database,
                                lambda: Held(release, started), 60)  # fmt: skip
        await holder.start()
        key = holder.store.session_key_for(SOURCE)
        await holder.handle_message(MessageEvent(text="think", source=SOURCE, message_id="m1"))
        await started.wait()
        other = stores("other", 60)
        for words, message_id in [("earlier", "m2"), ("/new hello there", "m3")]:
            message = MessageEvent(text=words, source=SOURCE, message_id=message_id)
            assert other._queue.add(key, message)
        for words, message_id in [("/queue later please", "m4"), ("plain", "m5")]:
            message = MessageEvent(text=words, source=SOURCE, message_id=message_id)
            await holder.handle_message(message)
        release.set()
        await _wait(lambda: len(held.texts()) >= 7, "the replies")
        await asyncio.sleep(0.5)  # nothing else is sent: a repeated reset would show
        await holder.idle()
        await holder.stop()
        return held.texts(), _queued(empty_database)

    texts, queued = asyncio.run(scenario())
    assert texts[1:] == ["echo: think", "echo: earlier", NEW_SESSION, "echo: hello there",
                         "echo: later please", "echo: plain"]  # fmt: skip
    assert queued == 0
