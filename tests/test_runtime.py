"""The asyncio Gateway: turns, queueing, commands, acks, gate and drain."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig, LifecycleEvent, MessageEvent, SessionEntry, hookimpl
from hermes_core.domain.models import MessageType, SessionSource
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter, TurnRequest
from hermes_core.gateway.lanes import Lane
from hermes_core.gateway.runtime import Gateway, GatewayParts
from hermes_core.gateway.texts import (
    ACK_INTERRUPT,
    ACK_QUEUED,
    NEW_SESSION,
    NOTHING_TO_STOP,
    QUEUE_USAGE,
    REFUSED_CAP,
)
from hermes_core.store import SessionStore
from hermes_core.testing import LifecycleRecorder, fresh_plugin_manager, telegram_dm

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Agents:
    """One EchoAgent per session, with a shared thinking delay; records overlap per key."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.by_session: dict[str, EchoAgent] = {}

    def hurry(self) -> None:
        """From now on every agent answers at once."""
        self.delay = 0.0
        for agent in self.by_session.values():
            agent.delay = 0.0

    def __call__(self, entry: SessionEntry) -> EchoAgent:
        agent = EchoAgent(self.delay)
        self.by_session[entry.session_id] = agent
        return agent


def _parts(gateway: Gateway) -> GatewayParts:
    """The parts a start built (what the tests that look inside a running gateway read)."""
    assert gateway._parts is not None
    return gateway._parts


def _event(text: str, chat: str = "1", user: str = "u1", **fields: Any) -> MessageEvent:
    return MessageEvent(source=telegram_dm(chat, user_id=user), text=text, **fields)


@pytest.fixture
def make_gateway(
    hermes_home: Path,
) -> Callable[..., tuple[Gateway, InMemoryAdapter, Agents]]:
    def make(delay: float = 0.0, **settings: Any) -> tuple[Gateway, InMemoryAdapter, Agents]:
        base: dict[str, Any] = {
            "gateway": {"housekeeping": {"initial_delay_secs": 3600}},
            "agent": {"restart_drain_timeout": 2},
        }
        for section, values in settings.items():
            base.setdefault(section, {}).update(values)
        config = GatewayConfig.from_dict(base, environ={"HERMES_HOME": str(hermes_home)})
        adapter, agents = InMemoryAdapter("telegram"), Agents(delay)
        gateway = Gateway(config, fresh_plugin_manager(hermes_home), agents, [adapter])
        return gateway, adapter, agents

    return make


async def _started(gateway: Gateway) -> Gateway:
    await gateway.start()
    return gateway


@pytest.mark.parametrize("synchronous", ["normal", "full"], ids=["inline-store", "threaded-store"])
async def test_a_message_runs_one_turn(make_gateway: Any, synchronous: str) -> None:
    gateway, adapter, _ = make_gateway(storage={"sqlite_synchronous": synchronous})
    await gateway.start()
    await gateway.handle_message(_event("hi"))
    await gateway.idle()
    assert adapter.texts() == ["echo: hi"]
    entry = gateway.store.lookup_by_session_key("agent:main:telegram:dm:c=1")
    assert entry is not None
    assert entry.active_turn_token is None
    roles = [m["role"] for m in gateway.store.load_transcript(entry.session_id)]
    assert roles == ["user", "assistant"]
    assert await gateway.stop()
    assert (gateway.config.hermes_home / ".clean_shutdown").exists()


async def test_the_prompt_cache_keeps_the_most_recently_used_sessions(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hermes_core.gateway.runner.PROMPT_CACHE_SIZE", 2)
    gateway, adapter, _ = make_gateway()
    await gateway.start()
    for chat in ("1", "2", "1", "3"):  # chat 2 is the least recently used when 3 arrives
        await gateway.handle_message(_event(f"hi {chat}", chat=chat))
        await gateway.idle()
    sessions = [gateway.store.lookup_by_session_key(f"agent:main:telegram:dm:c={chat}")
                for chat in ("1", "3")]  # fmt: skip
    prompts = _parts(gateway).runner._prompts
    assert [key[0] for key in prompts] == [entry.session_id for entry in sessions if entry]
    assert len(prompts) == 2
    assert adapter.texts() == ["echo: hi 1", "echo: hi 2", "echo: hi 1", "echo: hi 3"]
    assert await gateway.stop()


async def test_the_prompt_is_reused_for_an_equal_source_and_rebuilt_for_a_changed_one(
    hermes_home: Path,
) -> None:
    prompts: list[str] = []

    class Recording(EchoAgent):
        async def run_turn(self, request: TurnRequest) -> str | None:
            prompts.append(request.system_prompt)
            return await super().run_turn(request)

    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda _: Recording(), [adapter])
    await gateway.start()
    for name in ("Ann", "Ann", "Bea"):  # a new but equal source object, then a renamed user
        source = telegram_dm("1", user_id="u1", user_name=name)
        await gateway.handle_message(MessageEvent(source=source, text="hi"))
        await gateway.idle()
    assert '**User:** "Ann"' in prompts[0]
    assert prompts[1] is prompts[0]  # the cached prompt itself
    assert '**User:** "Bea"' in prompts[2]
    assert len(_parts(gateway).runner._prompts) == 2
    assert await gateway.stop()


async def test_a_caller_cancelled_while_its_message_is_stored_leaves_the_turn_running(
    make_gateway: Any,
) -> None:
    """The adapter gives up on ``handle_message`` before the turn's first commit: the turn
    still runs and its reply is sent (the lane is never left stuck)."""
    gateway, adapter, _ = make_gateway()
    await gateway.start()
    handling = asyncio.create_task(gateway.handle_message(_event("hi")))
    await asyncio.sleep(0)  # the lane task is started; its first commit is not done yet
    assert _parts(gateway).lanes.get("agent:main:telegram:dm:c=1") is not None
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling
    await gateway.idle()
    assert adapter.texts() == ["echo: hi"]
    entry = gateway.store.lookup_by_session_key("agent:main:telegram:dm:c=1")
    assert entry is not None
    assert entry.active_turn_token is None
    assert await gateway.stop()


@pytest.mark.slow
async def test_cancelling_a_caller_of_idle_leaves_the_turns_running(make_gateway: Any) -> None:
    """``wait_for(idle(), short)`` timing out cancels only the wait: the turn still answers."""
    gateway, adapter, _ = make_gateway(delay=0.5)
    await gateway.start()
    await gateway.handle_message(_event("slow question"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gateway.idle(), 0.05)
    await gateway.idle()
    assert adapter.texts() == ["echo: slow question"]
    assert await gateway.stop()


async def test_turns_of_one_key_never_overlap_and_keys_run_concurrently(make_gateway: Any) -> None:
    gateway, adapter, _agents = make_gateway(delay=0.2, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("a", chat="1"))
    await gateway.handle_message(_event("b", chat="2"))
    await gateway.handle_message(_event("c", chat="1", user="u2"))
    await asyncio.sleep(0.05)
    assert len(_parts(gateway).lanes.turn_tasks()) == 2  # both keys run at once
    await gateway.idle()
    assert adapter.texts("1") == [ACK_QUEUED, "echo: a", "echo: c"]
    assert adapter.texts("2") == ["echo: b"]
    await gateway.stop()


async def test_interrupt_mode_interrupts_and_runs_the_follow_up(make_gateway: Any) -> None:
    gateway, adapter, agents = make_gateway(delay=5.0)
    await gateway.start()
    await gateway.handle_message(_event("long task"))
    await asyncio.sleep(0.05)
    await gateway.handle_message(_event("actually, stop that", user="u2"))
    agents.hurry()  # the follow-up answers at once; the running turn keeps waiting its 5 s
    await gateway.idle()
    # The interrupted turn answers nothing (an agent that ignored the interrupt would answer
    # "echo: long task" after its 5 s); the follow-up runs next.
    assert adapter.texts() == [ACK_INTERRUPT, "echo: actually, stop that"]
    await gateway.stop()


async def test_burst_collapses_into_one_turn(make_gateway: Any) -> None:
    gateway, adapter, agents = make_gateway(delay=0.2, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("first"))
    await asyncio.sleep(0.02)
    for text in ("one", "two", "three"):
        await gateway.handle_message(_event(text))
    await gateway.idle()
    assert adapter.texts()[-1] == "echo: one\ntwo\nthree"
    assert sum(agent.turns for agent in agents.by_session.values()) == 2
    await gateway.stop()


@pytest.mark.slow
async def test_cap_refuses_honestly(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway(
        delay=0.3, display={"busy_input_mode": "queue"}, gateway={"busy_queue": {"max_pending": 1}}
    )
    await gateway.start()
    await gateway.handle_message(_event("running"))
    await asyncio.sleep(0.02)
    await gateway.handle_message(_event("waits", user="u2"))
    await gateway.handle_message(_event("too many", user="u3"))
    await gateway.idle()
    assert REFUSED_CAP.format(n=1) in adapter.texts()
    assert "echo: too many" not in adapter.texts()
    assert "echo: waits" in adapter.texts()
    await gateway.stop()


@pytest.mark.slow
async def test_queue_command(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway(delay=0.2, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("/queue"))
    assert adapter.texts() == [QUEUE_USAGE]
    await gateway.handle_message(_event("/queue idle lane runs now"))
    await asyncio.sleep(0.02)
    await gateway.handle_message(_event("/queue later one"))
    await gateway.handle_message(_event("/queue later two"))
    await gateway.idle()
    texts = adapter.texts()
    assert "Queued for the next turn." in texts
    assert "Queued for the next turn. (2 queued)" in texts
    replies = [t for t in texts if t.startswith("echo:")]
    assert replies == ["echo: idle lane runs now", "echo: later one", "echo: later two"]
    await gateway.stop()


@pytest.mark.parametrize("synchronous", ["normal", "full"], ids=["inline-store", "threaded-store"])
async def test_stop_discards_the_follow_up_but_keeps_queue_items(
    make_gateway: Any, synchronous: str
) -> None:
    gateway, adapter, agents = make_gateway(
        delay=5.0, display={"busy_input_mode": "queue"},
        storage={"sqlite_synchronous": synchronous},
    )  # fmt: skip
    await gateway.start()
    await gateway.handle_message(_event("/stop"))
    assert adapter.texts() == [NOTHING_TO_STOP]
    await gateway.handle_message(_event("long task"))
    await asyncio.sleep(0.05)
    await gateway.handle_message(_event("follow-up a"))
    await gateway.handle_message(_event("follow-up b"))  # merged into the slot item
    await gateway.handle_message(_event("/queue kept item"))
    await gateway.handle_message(_event("build done", internal=True))
    agents.hurry()
    await gateway.handle_message(_event("/stop"))
    await gateway.idle()
    texts = adapter.texts()
    assert "Stopped. Discarded 2 queued messages." in texts
    assert "echo: kept item" in texts
    assert "echo: build done" in texts  # internal wake-ups survive /stop
    assert not any("follow-up" in t for t in texts if t.startswith("echo:"))
    entry = gateway.store.lookup_by_session_key("agent:main:telegram:dm:c=1")
    assert entry is not None
    assert entry.active_turn_token is None
    assert not entry.resume_pending
    await gateway.stop()


async def test_reset_trigger(make_gateway: Any) -> None:
    gateway, adapter, agents = make_gateway(delay=5.0, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("old conversation"))
    await asyncio.sleep(0.05)
    old = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    await gateway.handle_message(_event("queued human", user="u2"))
    wake = _event("background job finished", internal=True, metadata={"wake": True})
    await gateway.handle_message(wake)
    agents.hurry()
    await gateway.handle_message(_event("/NEW@hermes_bot fresh start"))
    await gateway.idle()
    new = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    assert new != old
    texts = adapter.texts()
    assert NEW_SESSION in texts
    assert "echo: fresh start" in texts
    assert "echo: queued human" not in texts
    assert "echo: background job finished" in texts  # internal wake-ups survive /new
    assert new is not None
    contents = [m.get("content") for m in gateway.store.load_transcript(new)]
    assert "fresh start" in contents
    await gateway.stop()


def _group_event(text: str) -> MessageEvent:
    source = SessionSource(platform="telegram", chat_id="-100", chat_type="group", user_id="u1")
    return MessageEvent(source=source, text=text)


async def _said(gateway: Gateway, event: MessageEvent) -> tuple[str | None, str | None]:
    """Handle ``event`` to the end: the lane's session id before and after."""
    key = gateway.store.session_key_for(event.source)
    before = gateway.store.peek_session_id(key)
    await gateway.handle_message(event)
    await gateway.idle()
    return before, gateway.store.peek_session_id(key)


@pytest.mark.parametrize("make_event", [_group_event, _event], ids=["group", "dm"])
async def test_addressed_commands_are_obeyed_only_for_this_bots_name(
    make_gateway: Any, make_event: Callable[[str], MessageEvent]
) -> None:
    gateway, adapter, _ = make_gateway(
        platforms={"telegram": {"bot_username": "Hermes_Bot"}},
        gateway={"reset_triggers": ["/new", "/reset", "/fresh"]},
    )
    await gateway.start()
    await _said(gateway, make_event("hello"))
    others = ["/new@OtherBot", "/reset@otherbot later", "/fresh@OtherBot", "/stop@x", "/queue@x q"]
    for text in others:
        before, after = await _said(gateway, make_event(text))
        assert after == before, text  # not a command: no new session
    assert adapter.texts() == ["echo: hello", *(f"echo: {text}" for text in others)]
    for text in ("/NEW@hermes_bot", "/fresh@HERMES_BOT", "/new"):
        before, after = await _said(gateway, make_event(text))
        assert after != before, text
        assert adapter.texts()[-1] == NEW_SESSION
    await _said(gateway, make_event("/Stop@hermes_BOT"))
    assert adapter.texts()[-1] == NOTHING_TO_STOP
    await gateway.stop()


async def test_without_a_bot_username_addressed_commands_count_only_in_dms(
    make_gateway: Any,
) -> None:
    gateway, adapter, _ = make_gateway()
    await gateway.start()
    before, after = await _said(gateway, _group_event("/new@AnyBot"))
    assert before is None  # the message ran as a turn: the lane's first session
    assert adapter.texts() == ["echo: /new@AnyBot"]
    current = after
    before, after = await _said(gateway, _group_event("/new"))
    assert (before, adapter.texts()[-1]) == (current, NEW_SESSION)
    assert after != before
    await _said(gateway, _event("hi"))
    before, after = await _said(gateway, _event("/new@AnyBot"))
    assert adapter.texts()[-1] == NEW_SESSION
    assert after != before
    await gateway.stop()


async def test_wake_bound_to_an_older_session_needs_the_resolver(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway()
    await gateway.start()
    await gateway.handle_message(_event("hello"))
    await gateway.idle()
    old = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    await gateway.handle_message(_event("/new"))
    await gateway.idle()
    phase, lanes = gateway._phase, _parts(gateway).lanes
    phase.gate = True  # queue the wake behind the gate, then let it through
    await gateway.handle_message(_event("work done", internal=True, bound_session_id=old))
    phase.gate = False
    lanes.dispatch_next("agent:main:telegram:dm:c=1")
    await gateway.idle()
    assert "echo: work done" not in adapter.texts()  # no resolver: dropped, never run
    gateway.callbacks.wake_allowed = lambda event, session_id: True
    phase.gate = True
    await gateway.handle_message(_event("work done", internal=True, bound_session_id=old))
    phase.gate = False
    lanes.dispatch_next("agent:main:telegram:dm:c=1")
    await gateway.idle()
    assert "echo: work done" in adapter.texts()
    await gateway.stop()


@pytest.mark.slow
async def test_acknowledgements_are_rate_limited_and_can_be_disabled(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway(delay=0.3, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("busy"))
    await asyncio.sleep(0.02)
    await gateway.handle_message(_event("a", user="u2"))
    await gateway.handle_message(_event("b", user="u3"))
    await gateway.idle()
    assert adapter.texts().count(ACK_QUEUED) == 1
    await gateway.stop()
    quiet, quiet_adapter, _ = make_gateway(delay=0.3, display={"busy_input_mode": "queue"},
                                           gateway={"busy_ack_enabled": False})  # fmt: skip
    await quiet.start()
    await quiet.handle_message(_event("busy"))
    await asyncio.sleep(0.02)
    await quiet.handle_message(_event("a", user="u2"))
    await quiet.idle()
    assert ACK_QUEUED not in quiet_adapter.texts()
    await quiet.stop()


@pytest.mark.parametrize("synchronous", ["normal", "full"], ids=["inline-store", "threaded-store"])
async def test_drain_that_times_out_resumes_after_restart(
    make_gateway: Any, synchronous: str
) -> None:
    gateway, _adapter, _ = make_gateway(
        delay=30.0, agent={"restart_drain_timeout": 0.2},
        storage={"sqlite_synchronous": synchronous},
    )  # fmt: skip
    await gateway.start()
    await gateway.handle_message(_event("slow question"))
    await asyncio.sleep(0.05)
    assert not await gateway.stop(restart=True)
    home = gateway.config.hermes_home
    assert not (home / ".clean_shutdown").exists()
    again, adapter2, _ = make_gateway()
    await again.start()
    await again.idle()
    assert adapter2.texts() == ["echo: slow question"]
    entry = again.store.lookup_by_session_key("agent:main:telegram:dm:c=1")
    assert entry is not None
    assert not entry.resume_pending
    notes = [m for m in again.store.load_transcript(entry.session_id)
             if str(m.get("content", "")).startswith("[System note")]  # fmt: skip
    assert len(notes) == 1
    assert "a gateway restart" in notes[0]["content"]
    await again.stop()


async def test_drain_in_time_clears_the_mark(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway(delay=0.2)
    await gateway.start()
    await gateway.handle_message(_event("quick"))
    await asyncio.sleep(0.02)
    assert await gateway.stop()
    assert adapter.texts() == ["echo: quick"]
    assert (gateway.config.hermes_home / ".clean_shutdown").exists()


async def test_messages_during_drain_are_queued_for_after_the_restart(make_gateway: Any) -> None:
    gateway, adapter, _ = make_gateway(delay=0.3)
    await gateway.start()
    await gateway.handle_message(_event("running"))
    await asyncio.sleep(0.02)
    stopping = asyncio.create_task(gateway.stop(restart=True))
    await asyncio.sleep(0.02)
    await gateway.handle_message(_event("arrived late", user="u2"))
    await stopping
    assert (
        "⏳ Gateway restarting — queued for the next turn after it comes back." in adapter.texts()
    )
    again, adapter2, _ = make_gateway()
    await again.start()
    await again.idle()
    assert adapter2.texts() == ["echo: arrived late"]
    await again.stop()


class _Exploding:
    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        raise RuntimeError("observer bug")


async def test_observers_fire_and_a_failing_one_never_breaks_a_turn(
    hermes_home: Path,
) -> None:
    plugins = fresh_plugin_manager(hermes_home)
    recorder = LifecycleRecorder()
    plugins.register(_Exploding(), name="exploding")
    plugins.register(recorder, name="recorder")
    config = GatewayConfig.from_dict({"agent": {"agent_cache": {"max_size": 1}}},
                                     environ={"HERMES_HOME": str(hermes_home)})  # fmt: skip
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, plugins, Agents(), [adapter])
    await gateway.start()
    for chat in ("1", "2"):
        await gateway.handle_message(_event("hi", chat=chat))
        await gateway.idle()
    await gateway.stop()
    assert adapter.texts() == ["echo: hi", "echo: hi"]
    for kind in ("session_created", "turn_started", "turn_ended", "agent_soft_released",
                 "agent_cleaned_up"):  # fmt: skip
        assert kind in recorder.kinds, kind


@pytest.mark.slow
async def test_photo_album_merges(make_gateway: Any) -> None:
    gateway, adapter, agents = make_gateway(delay=0.2, display={"busy_input_mode": "queue"})
    await gateway.start()
    await gateway.handle_message(_event("busy"))
    await asyncio.sleep(0.02)
    await gateway.handle_message(_event("look", message_type=MessageType.PHOTO, media_urls=("a",)))
    await gateway.handle_message(_event("", message_type=MessageType.PHOTO, media_urls=("b",)))
    await gateway.idle()
    assert adapter.texts()[-1] == "echo: look"
    assert sum(agent.turns for agent in agents.by_session.values()) == 2
    await gateway.stop()


@pytest.mark.slow
async def test_startup_gate_holds_messages_until_resumed_turns_end(make_gateway: Any) -> None:
    first, _adapter, _ = make_gateway(delay=30.0, agent={"restart_drain_timeout": 0.1})
    await first.start()
    await first.handle_message(_event("interrupted question"))
    await asyncio.sleep(0.05)
    await first.stop(restart=True)  # the drain times out: the turn resumes at the next start
    gateway, adapter, agents = make_gateway(delay=0.3)
    starting = asyncio.create_task(gateway.start())
    while gateway.queue is None:  # recovery ran; the gate is up while the resume turn runs
        await asyncio.sleep(0.01)
    await gateway.handle_message(_event("while starting, same lane", user="u2"))
    await gateway.handle_message(_event("while starting, other lane", chat="2"))
    assert adapter.texts() == []  # nothing answered or acknowledged behind the gate
    await starting
    agents.hurry()
    await gateway.idle()
    assert adapter.texts("1") == ["echo: interrupted question", "echo: while starting, same lane"]
    assert adapter.texts("2") == ["echo: while starting, other lane"]
    await gateway.stop()


async def test_housekeeping_pass_is_isolated(make_gateway: Any, monkeypatch: Any) -> None:
    gateway, _, _ = make_gateway(
        agent={"agent_cache": {"idle_ttl_secs": 0.01}},
        gateway={"sessions_json_interval_secs": 0.01},
    )
    await gateway.start()
    await gateway.handle_message(_event("hi"))
    await gateway.idle()
    await asyncio.sleep(0.05)
    from hermes_core.gateway.housekeeping import Housekeeping

    housekeeping = Housekeeping(gateway.config, gateway.store, gateway.cache)

    def broken() -> int:
        raise RuntimeError("pressure signal exploded")

    monkeypatch.setattr(gateway.cache, "sweep_pressure", broken)
    results = housekeeping.run_once()
    assert results["idle_sweep"] == 1  # the idle agent was soft-released
    assert isinstance(results["pressure_sweep"], RuntimeError)
    assert results["prune"] == 0  # the tasks after the failing one still ran
    assert results["sessions_json"] is True
    assert (gateway.store.sessions_dir / "sessions.json").exists()
    assert gateway.store.lookup_by_session_key("agent:main:telegram:dm:c=1") is not None
    await gateway.stop()


class _SlowAdapter(InMemoryAdapter):
    """Takes its time to send replies (not notices)."""

    async def send(self, source: Any, text: str, *, reply_to: str | None = None) -> Any:
        if text.startswith("echo:"):
            await asyncio.sleep(0.3)
        return await super().send(source, text, reply_to=reply_to)


async def test_stop_during_delivery_lets_the_reply_finish(hermes_home: Path) -> None:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    adapter = _SlowAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), Agents(), [adapter])
    await gateway.start()
    await gateway.handle_message(_event("question"))
    await asyncio.sleep(0.1)  # the agent answered; the reply is being sent
    await gateway.handle_message(_event("/stop"))
    await gateway.idle()
    assert adapter.texts() == ["echo: question", "Stopped."]
    ledger = gateway.store._obligations.ledger
    assert ledger is not None
    assert ledger.rows.obligations(("pending", "attempting", "failed")) == []
    entry = gateway.store.lookup_by_session_key("agent:main:telegram:dm:c=1")
    assert entry is not None
    assert entry.active_turn_token is None
    await gateway.stop()


async def test_disconnected_platform_waits_and_reconnect_catches_up(make_gateway: Any) -> None:
    from hermes_core.turns.ledger import RECONNECT_PREFIX, SendResult

    gateway, adapter, _ = make_gateway()
    await gateway.start()
    adapter.fail_with = SendResult(ok=False, failure_kind="disconnected", error="socket closed")
    await gateway.handle_message(_event("sent while the link drops"))
    await gateway.idle()  # the reply could not be sent: its ledger row is "failed"
    adapter.fail_with = None
    adapter.connected = False
    await gateway.handle_message(_event("arrives while offline", chat="2"))
    await gateway.idle()
    assert gateway.queue is not None
    assert gateway.queue.depth("agent:main:telegram:dm:c=2") == 1  # waits, never dropped
    adapter.connected = True
    await gateway.platform_connected("telegram")
    await gateway.idle()
    assert adapter.texts("1") == [f"{RECONNECT_PREFIX}\n\necho: sent while the link drops"]
    assert adapter.texts("2") == ["echo: arrives while offline"]
    await gateway.stop()


async def test_a_suspended_lane_starts_a_new_session_and_says_so_once(make_gateway: Any) -> None:
    from hermes_core.gateway.texts import SUSPENDED_NOTICE

    gateway, adapter, _ = make_gateway()
    await gateway.start()
    await gateway.handle_message(_event("before"))
    await gateway.idle()
    key = "agent:main:telegram:dm:c=1"
    first = gateway.store.peek_session_id(key)
    assert gateway.store.suspend_session(key)
    await gateway.handle_message(_event("after the suspension"))
    await gateway.idle()
    await gateway.handle_message(_event("and later"))
    await gateway.idle()
    assert adapter.texts() == [
        "echo: before",
        SUSPENDED_NOTICE,
        "echo: after the suspension",
        "echo: and later",
    ]
    assert gateway.store.peek_session_id(key) != first
    await gateway.stop()


LATER = ("/queue later please", "plain text after it")
"""What a user sends right after ``/new``: both belong to the new session and are answered."""


def _answered_after_the_reset(gateway: Gateway, adapter: InMemoryAdapter, old: str | None) -> None:
    texts = adapter.texts()
    assert NEW_SESSION in texts
    answers = [text for text in texts[texts.index(NEW_SESSION) :] if text.startswith("echo:")]
    assert answers == ["echo: later please", "echo: plain text after it"]  # in order
    new = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    assert new is not None
    assert new != old
    contents = [m.get("content") for m in gateway.store.load_transcript(new)]
    assert contents == ["later please", "echo: later please", "plain text after it",
                        "echo: plain text after it"]  # fmt: skip
    assert gateway.queue is not None
    assert gateway.queue.depth("agent:main:telegram:dm:c=1") == 0


@pytest.mark.slow
async def test_a_reset_held_by_the_gate_keeps_what_came_after_it(make_gateway: Any) -> None:
    first, _adapter, _ = make_gateway(delay=30.0, agent={"restart_drain_timeout": 0.1})
    await first.start()
    await first.handle_message(_event("interrupted question"))
    await asyncio.sleep(0.05)
    await first.stop(restart=True)  # the drain times out: the turn resumes at the next start
    old = first.store.peek_session_id("agent:main:telegram:dm:c=1")
    gateway, adapter, agents = make_gateway(delay=0.3)
    starting = asyncio.create_task(gateway.start())
    while gateway.queue is None:  # the gate is up while the resumed turn runs
        await asyncio.sleep(0.01)
    for text in ("/new", *LATER):
        await gateway.handle_message(_event(text))
    await starting
    agents.hurry()
    await gateway.idle()
    assert adapter.texts()[0] == "echo: interrupted question"
    _answered_after_the_reset(gateway, adapter, old)
    await gateway.stop()


async def test_a_reset_queued_by_a_drain_keeps_what_came_after_it_after_the_restart(
    make_gateway: Any,
) -> None:
    gateway, adapter, _ = make_gateway(delay=0.3)
    await gateway.start()
    await gateway.handle_message(_event("running"))
    await asyncio.sleep(0.02)
    old = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    stopping = asyncio.create_task(gateway.stop(restart=True))
    await asyncio.sleep(0.02)
    for text in ("/new", *LATER):
        await gateway.handle_message(_event(text))
    assert await stopping
    assert adapter.texts()[-1] == "echo: running"
    again, adapter2, _ = make_gateway()
    await again.start()
    await again.idle()
    _answered_after_the_reset(again, adapter2, old)
    await again.stop()


async def test_a_reset_on_a_busy_lane_keeps_what_came_after_it(hermes_home: Path) -> None:
    """Messages that arrive while ``/new`` waits for the running turn to stop are the new
    session's first messages, never discarded with the old session's queue."""
    stopped = asyncio.Event()
    may_end = asyncio.Event()

    class SlowToStop(EchoAgent):
        async def run_turn(self, request: TurnRequest) -> str | None:
            if request.message != "long task":
                return await super().run_turn(request)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stopped.set()
                await may_end.wait()
                raise
            return None

    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda _: SlowToStop(), [adapter])
    await gateway.start()
    await gateway.handle_message(_event("long task"))
    await gateway.handle_message(_event("queued before the reset", user="u2"))
    old = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    resetting = asyncio.create_task(gateway.handle_message(_event("/new")))
    await asyncio.wait_for(stopped.wait(), 10)  # the reset is waiting for the turn to stop
    for text in LATER:
        await gateway.handle_message(_event(text))
    may_end.set()
    await resetting
    await gateway.idle()
    assert "echo: queued before the reset" not in adapter.texts()
    _answered_after_the_reset(gateway, adapter, old)
    await gateway.stop()


async def test_queued_items_are_capped_across_lanes(hermes_home: Path) -> None:
    """``max_pending`` set huge: ``max_total`` still bounds the items all lanes hold (in
    memory too); what is accepted runs in order, what is refused is told so."""
    release = asyncio.Event()

    class Holding(EchoAgent):
        async def run_turn(self, request: TurnRequest) -> str | None:
            if request.message == "hold":
                await release.wait()
            return await super().run_turn(request)

    settings = {"busy_queue": {"max_pending": 1_000_000, "max_total": 20,
                               "burst_window_secs": 0}, "busy_ack_enabled": False}  # fmt: skip
    config = GatewayConfig.from_dict(
        {"gateway": settings, "display": {"busy_input_mode": "queue"}},
        environ={"HERMES_HOME": str(hermes_home)},
    )
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda _: Holding(), [adapter])
    await gateway.start()
    chats = ("1", "2", "3")
    for chat in chats:
        await gateway.handle_message(_event("hold", chat=chat))
    for n in range(45):
        await gateway.handle_message(_event(f"m{n}", chat=chats[n % 3], user=f"u{n}"))
    assert gateway.queue is not None
    assert gateway.queue.total() == 20  # 45 sent, 20 held
    release.set()
    await gateway.idle()
    from hermes_core.gateway.texts import REFUSED_FULL

    for chat in chats:
        texts = adapter.texts(chat)
        sent = [f"m{n}" for n in range(45) if chats[n % 3] == chat]
        answered = [text.removeprefix("echo: ") for text in texts if text.startswith("echo: m")]
        assert answered == sent[: len(answered)]  # the accepted ones, in order, none lost
        assert texts.count(REFUSED_FULL) == len(sent) - len(answered)
    assert sum(text.startswith("echo: m") for text in adapter.texts()) == 20
    await gateway.stop()


@pytest.mark.slow
async def test_the_text_after_a_held_reset_is_the_new_sessions_first_message(
    make_gateway: Any,
) -> None:
    """``/new <text>`` queued behind the gate: its text runs before what was sent after it."""
    first, _adapter, _ = make_gateway(delay=30.0, agent={"restart_drain_timeout": 0.1})
    await first.start()
    await first.handle_message(_event("interrupted question"))
    await asyncio.sleep(0.05)
    await first.stop(restart=True)
    gateway, _adapter, agents = make_gateway(delay=0.3)
    starting = asyncio.create_task(gateway.start())
    while gateway.queue is None:
        await asyncio.sleep(0.01)
    await gateway.handle_message(_event("/new fresh start"))
    await gateway.handle_message(_event("plain text after it"))
    await starting
    agents.hurry()
    await gateway.idle()
    new = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    assert new is not None
    contents = [m.get("content") for m in gateway.store.load_transcript(new)]
    assert contents == ["fresh start", "echo: fresh start", "plain text after it",
                        "echo: plain text after it"]  # fmt: skip
    await gateway.stop()


async def test_a_message_sent_while_a_reset_finishes_belongs_to_the_new_session(
    hermes_home: Path,
) -> None:
    """A message that arrives after ``/new <text>``, while the old agent is being cleaned up,
    runs in the new session, after the reset's own text."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class SlowCleanup(EchoAgent):
        def cleanup(self) -> None:
            entered.set()
            release.wait(30)

    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda _: SlowCleanup(), [adapter])
    await gateway.start()
    await gateway.handle_message(_event("hello"))
    await gateway.idle()
    old = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    resetting = asyncio.create_task(gateway.handle_message(_event("/new fresh start")))
    while not entered.is_set():  # the reset is cleaning up the old session's agent
        await asyncio.sleep(0.01)
    await gateway.handle_message(_event("plain text after it"))
    release.set()
    await resetting
    await gateway.idle()
    new = gateway.store.peek_session_id("agent:main:telegram:dm:c=1")
    assert new is not None
    assert new != old
    assert old is not None
    earlier = [m.get("content") for m in gateway.store.load_transcript(old)]
    assert earlier == ["hello", "echo: hello"]
    contents = [m.get("content") for m in gateway.store.load_transcript(new)]
    assert contents == ["fresh start", "echo: fresh start", "plain text after it",
                        "echo: plain text after it"]  # fmt: skip
    await gateway.stop()


async def test_a_resume_due_while_its_lane_is_busy_runs_once_the_lane_is_idle(
    hermes_home: Path,
) -> None:
    """A connector that starts taking events before the gateway hears that its platform is
    connected: the platform's redelivery of the interrupted lane's message (recognised, so no
    turn) keeps the lane busy just as the resume is due; the resume runs when it goes idle."""
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(hermes_home)})
    source = telegram_dm("5", user_id="5")
    event = MessageEvent(source=source, text="hello", message_id="m1")
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        key = store.get_or_create_session(source).session_key
        store.mark_turn_active(key, None, {"role": "user", "content": "hello"}, seen="m1")
    adapter = InMemoryAdapter("telegram", connected=False)  # connecting after the start
    plugins = fresh_plugin_manager(hermes_home)
    async with Gateway(config, plugins, lambda entry: EchoAgent(), [adapter]) as gateway:
        lanes = _parts(gateway).lanes
        adapter.connected = True
        lanes._lanes[key] = Lane()  # busy: the redelivered message is being recognised
        await gateway.platform_connected("telegram")
        await asyncio.sleep(0.2)
        assert adapter.sent == []  # not resumed under the busy lane
        del lanes._lanes[key]
        await gateway.handle_message(event)  # recognised as delivered again: no turn
        for _ in range(500):
            if adapter.sent:
                break
            await asyncio.sleep(0.01)
        await gateway.idle()
    assert adapter.texts() == ["echo: hello"]
