"""Faults on the Gateway's turn path: stored before acknowledged, never silent.

Each test drives the real ``Gateway`` and injects a fault at one stage: the store refusing the
turn's first commit, the database locked past the busy timeout, a reply that cannot be stored, a
queued message whose turn never starts, a lost PostgreSQL connection. The sender is told, nothing
acknowledged is lost, and the lane and the other lanes go on.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.tcp_proxy import proxied

from hermes_core import GatewayConfig, MessageEvent, SessionEntry
from hermes_core.domain.errors import MessageNotStoredError, StoreError
from hermes_core.gateway import delivery, lanes
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter, TurnRequest
from hermes_core.gateway.runtime import Gateway
from hermes_core.gateway.texts import REFUSED_NOT_SAVED, TURN_FAILED
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.turns.ledger import (
    RATE_LIMIT_PREFIX,
    RECONNECT_PREFIX,
    RESTART_PREFIX,
    SendResult,
)
from hermes_core.turns.pipeline import Turn

Make = Callable[..., tuple[Gateway, InMemoryAdapter]]
KEY = "agent:main:telegram:dm:c=1"


def _event(
    text: str, chat: str = "1", message_id: str | None = None, user_id: str = "u1"
) -> MessageEvent:
    source = telegram_dm(chat, user_id=user_id)
    return MessageEvent(source=source, text=text, message_id=message_id)


class SlowFirst(EchoAgent):
    """Thinks ``delay`` seconds on its first turn only (so later messages queue behind it)."""

    async def run_turn(self, request: TurnRequest) -> str | None:
        if self.turns:
            self.delay = 0.0
        return await super().run_turn(request)


@pytest.fixture
def make(hermes_home: Path) -> Make:
    def build(
        *, factory: Callable[[SessionEntry], Any] | None = None, **settings: Any
    ) -> tuple[Gateway, InMemoryAdapter]:
        base: dict[str, Any] = {
            "gateway": {"housekeeping": {"initial_delay_secs": 3600}, "busy_ack_enabled": False},
            "display": {"busy_input_mode": "queue"},
        }
        for section, values in settings.items():
            base.setdefault(section, {}).update(values)
        config = GatewayConfig.from_dict(base, environ={"HERMES_HOME": str(hermes_home)})
        adapter = InMemoryAdapter("telegram")
        agents = factory or (lambda entry: EchoAgent())
        gateway = Gateway(config, fresh_plugin_manager(hermes_home), agents, [adapter])
        return gateway, adapter

    return build


def _transcript(store: SessionStore, key: str = KEY) -> list[str]:
    entry = store.lookup_by_session_key(key)
    if entry is None:
        return []
    return [str(m["content"]) for m in store.load_transcript(entry.session_id)]


async def test_a_turn_that_cannot_be_stored_is_refused_and_raised(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway, adapter = make()
    await gateway.start()
    pipeline = gateway.pipeline
    assert pipeline is not None
    begin = pipeline.begin

    def broken(key: str, event: MessageEvent, consumed: int | None = None) -> Turn | None:
        if event.text == "hello":
            raise StoreError("disk full")
        return begin(key, event, consumed)

    monkeypatch.setattr(pipeline, "begin", broken)
    event = _event("hello", message_id="m1")
    with pytest.raises(MessageNotStoredError, match="delivers it again"):
        await gateway.handle_message(event)
    assert adapter.texts() == [REFUSED_NOT_SAVED]
    assert _transcript(gateway.store) == []
    for _ in range(3):  # delivered again during the outage: refused, the sender told once
        with pytest.raises(MessageNotStoredError):
            await gateway.handle_message(event)
    assert adapter.texts() == [REFUSED_NOT_SAVED]
    await gateway.handle_message(_event("other lane", chat="2"))  # other lanes go on
    await gateway.idle()
    monkeypatch.setattr(pipeline, "begin", begin)
    await gateway.handle_message(event)  # the platform delivers it again: now it is answered
    await gateway.idle()
    assert adapter.texts() == [REFUSED_NOT_SAVED, "echo: other lane", "echo: hello"]
    await gateway.stop()


@pytest.mark.slow
async def test_a_locked_database_refuses_without_freezing_the_loop(
    make: Make, hermes_home: Path
) -> None:
    gateway, adapter = make(storage={"sqlite_busy_timeout_secs": 0.3})
    await gateway.start()
    await gateway.handle_message(_event("before", message_id="m0"))
    await gateway.idle()
    holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    with pytest.raises(MessageNotStoredError):
        await gateway.handle_message(_event("during the lock", message_id="m1"))
    ticking.cancel()
    assert ticks >= 20  # the loop kept running while the writer waited for the lock
    holder.execute("ROLLBACK")
    holder.close()
    await gateway.handle_message(_event("during the lock", message_id="m1"))  # redelivered
    await gateway.idle()
    assert adapter.texts() == ["echo: before", REFUSED_NOT_SAVED, "echo: during the lock"]
    assert _transcript(gateway.store).count("during the lock") == 1
    await gateway.stop()


async def test_a_reply_that_cannot_be_stored_is_reported_and_the_lane_goes_on(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway, adapter = make(agent={"agent_cache": {"idle_ttl_secs": 0.01}})
    await gateway.start()
    store = gateway.store
    backend: Any = store._backing.backend
    transcripts = backend._transcripts  # every message insert goes through it
    insert = transcripts.insert

    def refuse_bad(cursor: Any, row: Any) -> int:
        if row["content"] == "echo: bad":  # the database refuses this reply, wherever it goes
            raise backend._conn.driver_error("injected: the reply cannot be stored")
        return int(insert(cursor, row))

    monkeypatch.setattr(transcripts, "insert", refuse_bad)
    await gateway.handle_message(_event("bad"))
    await gateway.idle()
    assert adapter.texts() == [TURN_FAILED]
    entry = store.lookup_by_session_key(KEY)
    assert entry is not None
    assert entry.active_turn_token is None  # the turn was closed
    await asyncio.sleep(0.05)
    assert gateway.cache.sweep_idle() == 1  # its agent is not left "in flight"
    await gateway.handle_message(_event("good"))
    await gateway.idle()
    assert adapter.texts() == [TURN_FAILED, "echo: good"]
    await gateway.stop()


@pytest.mark.parametrize("burst", [1, 2], ids=["message", "merged-burst"])
async def test_a_poisoned_queued_message_is_dead_lettered(
    make: Make, hermes_home: Path, monkeypatch: pytest.MonkeyPatch, burst: int
) -> None:
    monkeypatch.setattr(lanes, "DISPATCH_RETRY_SECS", 0.01)
    gateway, adapter = make(factory=lambda entry: SlowFirst(0.3))
    await gateway.start()
    pipeline = gateway.pipeline
    assert pipeline is not None
    begin = pipeline.begin
    attempts: list[str] = []

    def poisoned(key: str, event: MessageEvent, consumed: int | None = None) -> Turn | None:
        if event.text.startswith("poison"):
            attempts.append(event.text)
            raise StoreError("this event can never start")
        return begin(key, event, consumed)

    monkeypatch.setattr(pipeline, "begin", poisoned)
    await gateway.handle_message(_event("first"))
    await asyncio.sleep(0.05)
    for n in range(burst):  # a burst is merged into one item of several rows
        await gateway.handle_message(_event(f"poison {n}", message_id=f"p{n}"))
    await gateway.handle_message(_event("after", message_id="a1", user_id="other"))
    for _ in range(200):
        await gateway.idle()
        if "echo: after" in adapter.texts():
            break
        await asyncio.sleep(0.01)
    assert len(attempts) >= gateway.config.gateway.max_dispatch_attempts
    assert adapter.texts() == ["echo: first", TURN_FAILED, "echo: after"]
    dead = gateway.store.dead_letters()
    assert [(letter.session_key, letter.attempts) for letter in dead] == [(KEY, 3)] * burst
    assert "never start" in (dead[0].last_error or "")
    await gateway.stop()
    again, again_adapter = make()
    await again.start()  # a dead letter is kept, never restored into the queue
    await again.idle()
    assert again_adapter.texts() == []
    assert again.queue is not None
    assert again.queue.depth(KEY) == 0
    await again.stop()


async def test_a_redelivery_after_a_restart_is_ignored(make: Make) -> None:
    gateway, adapter = make(factory=lambda entry: SlowFirst(0.3))
    await gateway.start()
    await gateway.handle_message(_event("answered", message_id="m1"))
    await asyncio.sleep(0.05)
    await gateway.handle_message(_event("queued", message_id="m2", user_id="other"))
    await gateway.handle_message(_event("queued", message_id="m2", user_id="other"))  # again
    await gateway.idle()
    await gateway.stop()
    assert adapter.texts() == ["echo: answered", "echo: queued"]
    restarted, later = make()
    await restarted.start()
    for message_id, text in (("m1", "answered"), ("m2", "queued")):
        await restarted.handle_message(_event(text, message_id=message_id))  # acknowledged
    await restarted.idle()
    assert later.texts() == []  # the store remembers what it has: nothing is answered twice
    assert _transcript(restarted.store) == ["answered", "echo: answered", "queued", "echo: queued"]
    await restarted.stop()


async def test_a_reconnect_sends_pending_and_attempting_replies(make: Make) -> None:
    gateway, adapter = make()
    adapter.connected = False
    await gateway.start()
    store = gateway.store
    rows = [
        store._turns.record_delivery_obligation(KEY, None, "telegram", "1", None, text, ref)
        for text, ref in (("owed", "m1"), ("maybe sent", "m2"))
    ]
    ledger = store._obligations.ledger
    assert ledger is not None
    assert rows[1] is not None
    ledger.rows.update_obligation(rows[1].obligation_id, {"state": "attempting", "attempts": 1})
    adapter.connected = True
    await gateway.platform_connected("telegram")
    assert sorted(adapter.texts()) == sorted(["owed", f"{RECONNECT_PREFIX}\n\nmaybe sent"])
    assert ledger.rows.obligations(("pending", "attempting", "failed")) == []
    await gateway.stop()


async def test_a_rate_limited_reply_is_retried_with_its_prefix(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "RATE_LIMIT_RETRY_SECS", 0.01)
    gateway, adapter = make()
    await gateway.start()
    adapter.fail_with = SendResult(ok=False, failure_kind="rate_limited", error="429")
    await gateway.handle_message(_event("question"))
    await gateway.idle()
    adapter.fail_with = None
    for _ in range(100):
        if adapter.texts():
            break
        await asyncio.sleep(0.01)
    assert adapter.texts() == [f"{RATE_LIMIT_PREFIX}\n\necho: question"]
    await gateway.stop()


async def test_a_rate_limited_reply_left_by_the_last_process_is_sent_at_start(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry timer of a rate-limited reply dies with its process: the next start sends the
    reply (with the restart prefix), rather than leaving it until it is abandoned as stale."""
    monkeypatch.setattr(delivery, "RATE_LIMIT_RETRY_SECS", 3600.0)
    gateway, adapter = make()
    await gateway.start()
    adapter.fail_with = SendResult(ok=False, failure_kind="rate_limited", error="429")
    await gateway.handle_message(_event("question"))
    await gateway.idle()
    await gateway.stop()
    assert adapter.texts() == []
    again, adapter = make()
    await again.start()
    await again.idle()
    assert adapter.texts() == [f"{RESTART_PREFIX}\n\necho: question"]
    await again.stop()


async def test_stop_flags_only_turns_still_running(make: Make) -> None:
    gateway, _adapter = make()
    await gateway.start()
    await gateway.handle_message(_event("done"))
    await gateway.idle()
    store = gateway.store
    assert not store.mark_resume_pending(KEY, "shutdown_timeout", only_if_running=True)
    entry = store.lookup_by_session_key(KEY)
    assert entry is not None
    assert not entry.resume_pending
    token = store.mark_turn_active(KEY)
    assert token is not None
    assert store.mark_resume_pending(KEY, "shutdown_timeout", only_if_running=True)
    await gateway.stop()


async def test_commands_queued_behind_a_drain_are_interpreted_after_the_restart(
    make: Make,
) -> None:
    gateway, _adapter = make(
        factory=lambda entry: EchoAgent(30.0), agent={"restart_drain_timeout": 0.1}
    )
    await gateway.start()
    await gateway.handle_message(_event("long"))
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(gateway.stop(restart=True))
    await asyncio.sleep(0.01)
    await gateway.handle_message(_event("/new"))
    await stopping
    first = gateway.store.peek_session_id(KEY) if gateway.state.store else None
    restarted, later = make()
    await restarted.start()
    await restarted.idle()
    entry = restarted.store.lookup_by_session_key(KEY)
    assert entry is not None
    assert entry.session_id != first  # /new took effect, not a turn with the text "/new"
    assert "✨ New session started." in later.texts()
    assert not any("/new" in text for text in later.texts())
    await restarted.stop()


async def test_housekeeping_is_waited_for_before_the_store_closes(
    make: Make, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gateway, _adapter = make(gateway={"housekeeping": {"initial_delay_secs": 0}})
    from hermes_core.gateway.housekeeping import Housekeeping

    original = Housekeeping.run_once
    entered = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(self: Housekeeping) -> dict[str, object]:
        loop.call_soon_threadsafe(entered.set)
        import time

        time.sleep(0.3)
        return original(self)

    monkeypatch.setattr(Housekeeping, "run_once", slow)
    await gateway.start()
    await entered.wait()
    await gateway.stop()  # the pass is still sleeping: stop waits for it
    assert "housekeeping task" not in caplog.text


def _admin_sql(url: str, *statements: str) -> None:
    """Run statements on a connection of their own (autocommit), e.g. to cut the store's."""
    from sqlalchemy import create_engine

    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


TERMINATE_OTHERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


async def test_terminated_postgres_connections_are_reopened(
    make: Make, empty_database: str
) -> None:
    gateway, adapter = make(storage={"url": empty_database})
    await gateway.start()
    await gateway.handle_message(_event("before"))
    await gateway.idle()
    _admin_sql(empty_database, TERMINATE_OTHERS)  # the server is still up: reconnect at once
    await gateway.handle_message(_event("after the loss", message_id="m2"))
    await gateway.idle()
    assert adapter.texts() == ["echo: before", "echo: after the loss"]
    assert _transcript(gateway.store) == ["before", "echo: before", "after the loss",
                                          "echo: after the loss"]  # fmt: skip
    assert gateway.store.health()["available"]
    await gateway.stop()


async def test_messages_during_a_postgres_outage_are_refused_then_stored_once_it_is_back(
    make: Make, empty_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hermes_plugins.sql_store.writers")
    with proxied(empty_database) as server:  # while ``down``, no connection gets through
        gateway, adapter = make(storage={"url": server.url})
        await gateway.start()
        await gateway.handle_message(_event("before"))
        await gateway.idle()
        server.down = True
        _admin_sql(empty_database, TERMINATE_OTHERS)
        with pytest.raises(MessageNotStoredError):
            await gateway.handle_message(_event("during", message_id="m2"))
        assert adapter.texts() == ["echo: before", REFUSED_NOT_SAVED]
        health = gateway.store.health()
        assert health["available"] is False
        assert "connection to the database is lost" in health["unavailable_reason"]
        server.down = False
        deadline = time.monotonic() + 10  # the next reconnect waits out its back-off
        while True:
            try:
                await gateway.handle_message(_event("after", message_id="m3"))
                break
            except MessageNotStoredError:
                assert time.monotonic() < deadline, "the store never reconnected"
                await asyncio.sleep(0.2)
        await gateway.idle()
        assert gateway.store.health()["available"]
        assert adapter.texts()[-1] == "echo: after"
        assert _transcript(gateway.store)[-2:] == ["after", "echo: after"]
        assert "during" not in _transcript(gateway.store)  # refused, so not stored either
        await gateway.stop()
    outage = [r.getMessage() for r in caplog.records if "connection to the database" in r.message]
    assert len(outage) == 2, outage  # logged once as lost, once as back
    assert "was lost" in outage[0]
    assert "is back" in outage[1]


@pytest.mark.slow
async def test_a_stop_while_a_message_is_being_stored_still_answers_it(
    make: Make, hermes_home: Path
) -> None:
    gateway, adapter = make(storage={"sqlite_busy_timeout_secs": 5})
    await gateway.start()
    holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the turn's first commit waits for this lock
    handling = asyncio.create_task(gateway.handle_message(_event("in flight", message_id="m1")))
    await asyncio.sleep(0.1)
    stopping = asyncio.create_task(gateway.stop())
    await asyncio.sleep(0.1)
    holder.execute("ROLLBACK")
    holder.close()
    await handling  # stored: the platform may acknowledge it
    await stopping
    restarted, later = make()
    await restarted.start()
    await restarted.idle()
    assert adapter.texts() + later.texts() == ["echo: in flight"]  # answered once, either side
    await restarted.stop()
