"""Serving a gateway: ``async with``, ``serve()`` until a signal, the ``Agent`` base class, the
warning for a platform without an adapter, and ``python -m hermes_core``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hermes_core import (
    Agent,
    Gateway,
    GatewayConfig,
    InMemoryAdapter,
    MessageEvent,
    SessionEntry,
    SessionStore,
    TurnRequest,
)
from hermes_core.gateway.texts import ACK_QUEUED
from hermes_core.testing import fresh_plugin_manager, telegram_dm

DRIVER = Path(__file__).parent / "support" / "serve_driver.py"
KEY = "agent:main:telegram:dm:c=7"


class ReplyAgent(Agent):
    """Only ``run_turn``: the rest are the base class's defaults."""

    def __init__(self, think: float = 0.0) -> None:
        self.think = think

    async def run_turn(self, request: TurnRequest) -> str | None:
        await asyncio.sleep(self.think)
        return f"re: {request.message}"


def _gateway(home: Path, think: float = 0.0, **settings: Any) -> tuple[Gateway, InMemoryAdapter]:
    base = {"gateway": {"housekeeping": {"initial_delay_secs": 3600}}, **settings}
    config = GatewayConfig.from_dict(base, environ={"HERMES_HOME": str(home)})
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(config, fresh_plugin_manager(home), lambda e: ReplyAgent(think), [adapter])
    return gateway, adapter


async def test_async_with_starts_and_stops_the_gateway(hermes_home: Path) -> None:
    gateway, adapter = _gateway(hermes_home)
    async with gateway as started:
        assert started is gateway
        await gateway.handle_message(MessageEvent(source=telegram_dm("1"), text="hi"))
        await gateway.idle()
    assert adapter.texts() == ["re: hi"]
    assert (hermes_home / ".clean_shutdown").exists()
    assert await gateway.stop()  # stopping again only reports the first stop
    again, _ = _gateway(hermes_home)
    async with again:  # the first one let go of the instance lock and the store
        assert again.store.lookup_by_session_key("agent:main:telegram:dm:c=1") is not None


@pytest.mark.slow
async def test_the_agent_base_class_defaults(hermes_home: Path) -> None:
    agent = ReplyAgent()
    assert isinstance(agent, Agent)
    assert await agent.interrupt() is False
    agent.soft_release()
    agent.cleanup()

    class NoTurn(Agent):
        pass

    with pytest.raises(TypeError, match="run_turn"):
        NoTurn()  # type: ignore[abstract]

    # Interrupt mode cannot interrupt such an agent: the follow-up is acknowledged as queued.
    gateway, adapter = _gateway(hermes_home, think=0.3)
    async with gateway:
        await gateway.handle_message(MessageEvent(source=telegram_dm("1"), text="one"))
        await gateway.handle_message(MessageEvent(source=telegram_dm("1"), text="two"))
        await gateway.idle()
    assert adapter.texts() == [ACK_QUEUED, "re: one", "re: two"]


async def test_an_event_without_an_adapter_is_queued_with_one_warning_per_platform(
    hermes_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gateway, adapter = _gateway(hermes_home)
    discord = [
        MessageEvent(source=telegram_dm(chat).model_copy(update={"platform": "discord"}), text=t)
        for chat, t in (("1", "a"), ("2", "b"))
    ]
    slack = MessageEvent(source=telegram_dm("3").model_copy(update={"platform": "slack"}), text="c")
    with caplog.at_level(logging.WARNING, logger="hermes_core.gateway.runtime"):
        async with gateway:
            for event in (*discord, slack, MessageEvent(source=telegram_dm("4"), text="d")):
                await gateway.handle_message(event)
            await gateway.idle()
            assert gateway.queue is not None
            assert gateway.queue.lanes()  # the discord and slack messages wait, stored
    warnings = [r.getMessage() for r in caplog.records if "no adapter" in r.getMessage()]
    assert len(warnings) == 2
    assert "'discord'" in warnings[0]
    assert "'slack'" in warnings[1]
    assert adapter.texts() == ["re: d"]


def _serve_child(home: Path, workdir: Path, think: float) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_")}
    environ["HERMES_HOME"] = str(home)
    settings = {"gateway": {"housekeeping": {"initial_delay_secs": 3600}},
                "agent": {"restart_drain_timeout": 60}}  # fmt: skip
    (home / "config.yaml").write_text(repr(settings).replace("'", '"'), encoding="utf-8")
    child = subprocess.Popen(
        [sys.executable, str(DRIVER), str(workdir), str(think)],
        env=environ, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (workdir / "ready").exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(f"the gateway did not come up:\n{child.communicate()[1]}")
        time.sleep(0.02)
    return child


def _lane(home: Path) -> SessionEntry:
    config = GatewayConfig.from_dict({}, environ={"HERMES_HOME": str(home)})
    store = SessionStore.open(config, plugins=fresh_plugin_manager(home), read_only=True)
    try:
        entry = store.lookup_by_session_key(KEY)
    finally:
        store.close()
    assert entry is not None
    return entry


@pytest.mark.slow
def test_sigterm_drains_the_running_turn_and_exits_cleanly(
    hermes_home: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    child = _serve_child(hermes_home, workdir, think=1.0)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert "SIGTERM: stopping after the running turns" in stderr
    assert "done: hello" in (workdir / "outbox.jsonl").read_text(encoding="utf-8")
    assert (hermes_home / ".clean_shutdown").exists()
    entry = _lane(hermes_home)
    assert entry.active_turn_token is None  # the turn finished in the drain: marker cleared
    assert not entry.resume_pending


@pytest.mark.slow
def test_a_second_signal_cuts_the_drain_short(hermes_home: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    child = _serve_child(hermes_home, workdir, think=120.0)
    child.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the drain is waiting for the turn
    started = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert time.monotonic() - started < 30  # not the turn's 120 s nor the 60 s drain
    assert child.returncode == 1, stderr  # not drained
    assert "SIGINT again: interrupting the running turns" in stderr
    assert not (workdir / "outbox.jsonl").exists()
    assert not (hermes_home / ".clean_shutdown").exists()
    entry = _lane(hermes_home)
    assert entry.active_turn_token is not None  # the turn resumes after the next start
    assert entry.resume_pending


def test_python_m_hermes_core_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "hermes_core", "--version"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hermes-sessions ")
