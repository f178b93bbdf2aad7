"""Memory per lane: a gateway serving many distinct lanes keeps what it caches per lane within
each cache's bound, and releases the rest when the lane goes idle."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import pytest

from hermes_core import GatewayConfig, MessageEvent
from hermes_core.gateway import inbound, runner, runtime
from hermes_core.gateway.agents import EchoAgent, InMemoryAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.store import SessionStore
from hermes_core.testing import fresh_plugin_manager, telegram_dm

LANES = 60
BOUND = 8
"""Each cache's bound in these tests, well below the lanes served."""
WAVE = 12
"""Messages sent before the gateway is let go idle (turns of several lanes at once)."""


def _config(home: Path, settings: dict[str, Any]) -> GatewayConfig:
    storage = {**settings.get("storage", {}), "entry_cache_size": BOUND}
    return GatewayConfig.from_dict(
        {
            "storage": storage,
            "gateway": {
                "housekeeping": {"initial_delay_secs": 3600},
                "write_sessions_json": False,  # the mirror holds every lane (its own bound)
            },
            "agent": {"agent_cache": {"max_size": BOUND, "protect_recent": 0}},
        },
        environ={"HERMES_HOME": str(home)},
    )


@pytest.fixture
def small_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caches whose size is a constant hold ``BOUND`` entries."""
    monkeypatch.setattr(runner, "PROMPT_CACHE_SIZE", BOUND)
    monkeypatch.setattr(runtime, "SEEN_MESSAGES", BOUND)
    monkeypatch.setattr(inbound, "SEEN_MESSAGES", BOUND)


@pytest.mark.usefixtures("small_caches")
async def test_per_lane_state_stays_within_bounds(
    hermes_home: Path, settings: dict[str, Any]
) -> None:
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(
        _config(hermes_home, settings),
        fresh_plugin_manager(hermes_home),
        lambda entry: EchoAgent(),
        [adapter],
    )
    await gateway.start()
    try:
        for first in range(0, LANES, WAVE):
            for lane in range(first, first + WAVE):
                source = telegram_dm(str(lane))
                event = MessageEvent(source=source, text=f"hi {lane}", message_id=f"m{lane}")
                await gateway.handle_message(event)
            await gateway.idle()
        assert sorted(message.chat_id for message in adapter.sent) == sorted(map(str, range(LANES)))
        store, parts = gateway.store, gateway._parts
        assert parts is not None
        entries = store._routes._cache
        cached = {
            "routing entries": len(entries.as_dicts()),
            "agents": len(gateway.cache),
            "session-context prompts": len(parts.runner._prompts),
            "seen platform messages": len(gateway._seen._seen),
        }
        assert cached == dict.fromkeys(cached, BOUND)
        assert len(entries._revisions) <= BOUND  # kept on a shared store only
        held: dict[str, Sized] = {
            "lanes": parts.lanes._lanes,
            "lane commands": parts.lanes._commands,
            "lane retries": parts.lanes._retrying,
            "queued lanes": parts.queue._lanes,
            "agents being built": gateway.cache._building,
            "leases": store._leases._held,
        }
        assert {name: len(items) for name, items in held.items()} == dict.fromkeys(held, 0)
    finally:
        await gateway.stop()


async def test_entry_cache_size_is_read_from_the_config(hermes_home: Path) -> None:
    """``storage.entry_cache_size`` bounds the store's routing entries; 10,000 by default."""
    assert GatewayConfig.from_dict({}).storage.entry_cache_size == 10_000
    with pytest.raises(ValueError, match=r"storage\.entry_cache_size"):
        GatewayConfig.from_dict({"storage": {"entry_cache_size": 0}})


async def test_start_reads_only_the_lanes_to_resume(
    hermes_home: Path, settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start resumes the lanes marked ``resume_pending`` without reading every routing
    entry into memory (a store of a million lanes once held them all, gigabytes, at start)."""
    config = _config(hermes_home, settings)
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        keys = [
            store.get_or_create_session(telegram_dm(str(lane))).session_key for lane in range(LANES)
        ]
        pending = keys[::WAVE]
        for key in pending:
            store.mark_resume_pending(key, "restart_timeout")
        backend = type(store._backing.backend)

    def every_route(self: object) -> Iterator[dict[str, Any]]:
        raise AssertionError("the whole routing index was read")

    monkeypatch.setattr(backend, "iter_routes", every_route)
    adapter = InMemoryAdapter("telegram")
    gateway = Gateway(
        config, fresh_plugin_manager(hermes_home), lambda entry: EchoAgent(), [adapter]
    )
    await gateway.start()
    try:
        await gateway.idle()
        resumed = {message.chat_id for message in adapter.sent}
        assert resumed == {str(lane) for lane in range(0, LANES, WAVE)}
        entries = [gateway.store.lookup_by_session_key(key) for key in pending]
        assert all(entry is not None and not entry.resume_pending for entry in entries)
    finally:
        await gateway.stop()
