"""The ``openai`` agent against a fake OpenAI-compatible endpoint that the test serves on the
loopback interface (:class:`support.loopback.LoopbackServer`): real HTTP, nothing in its path
mocked."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from support.loopback import LoopbackServer

from hermes_core import Gateway, GatewayConfig, InMemoryAdapter, MessageEvent, SessionEntry
from hermes_core.domain.errors import ConfigError
from hermes_core.gateway.agent_loading import LoadedAgent, load_agent
from hermes_core.gateway.agents import TurnRequest
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_plugins.agents.openai import ERROR_PREFIX, OpenAIAgents

KEY = "sk-test-0123456789"


@dataclass
class FakeEndpoint:
    """What the fake endpoint received, and how it answers the next requests."""

    url: str = ""
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    reply: str = "hello from the model"
    status: int = 200
    body: bytes | None = None
    """Sent as it is instead of a completion (an unreadable answer)."""
    stalled: bool = False
    """True: the endpoint answers only once it is false again (a slow model)."""

    async def completions(self, request: Request) -> Response:
        self.received.append((dict(request.headers), await request.json()))
        while self.stalled:
            await asyncio.sleep(0.01)
        if self.status != 200:
            return JSONResponse({"error": {"message": f"echoed {KEY}"}}, self.status)
        if self.body is not None:
            return Response(self.body, media_type="application/json")
        message = {"role": "assistant", "content": self.reply}
        return JSONResponse({"choices": [{"index": 0, "message": message}]})


@pytest.fixture
def endpoint() -> Iterator[FakeEndpoint]:
    fake = FakeEndpoint()
    app = Starlette(routes=[Route("/v1/chat/completions", fake.completions, methods=["POST"])])
    with LoopbackServer(app) as server:
        fake.url = f"{server.url}/v1"
        yield fake
        fake.stalled = False  # the stalled request ends, and the server with it


def _config(endpoint: FakeEndpoint, **options: Any) -> GatewayConfig:
    settings = {"base_url": endpoint.url, "model": "tiny-1", **options}
    return GatewayConfig.from_dict(
        {"agent": {"use": "openai", "options": settings},
         "gateway": {"housekeeping": {"initial_delay_secs": 3600}}},
        source="config.yaml",
    )  # fmt: skip


def _request(message: str, history: list[dict[str, Any]]) -> TurnRequest:
    return TurnRequest(
        session_key="agent:main:telegram:dm:c=5", session_id="s1", system_prompt="You are Hermes.",
        message=message, event=MessageEvent(source=telegram_dm("5"), text=message),
        load_history=lambda: history,
    )  # fmt: skip


def _entry() -> SessionEntry:
    now = datetime.now(timezone.utc)
    return SessionEntry(session_key="agent:main:telegram:dm:c=5", session_id="s1",
                        created_at=now, updated_at=now)  # fmt: skip


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return KEY


async def _turn(loaded: LoadedAgent, message: str, history: list[dict[str, Any]]) -> str | None:
    try:
        outcome = loaded.factory(_entry()).run_turn(_request(message, history))
        assert inspect.isawaitable(outcome)  # the openai agent answers with a finished reply
        reply: str | None = await outcome
        return reply
    finally:
        await loaded.aclose()


async def test_a_turn_sends_the_prompt_the_history_and_the_message(
    endpoint: FakeEndpoint, api_key: str
) -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "a tool's output"},
        {"role": "user", "content": [{"type": "image_url"}]},
        {"role": "assistant", "content": f"{ERROR_PREFIX} the model endpoint timed out."},
    ]
    loaded = load_agent(_config(endpoint, temperature=0.5, max_tokens=64))
    assert await _turn(loaded, "how are you?", history) == "hello from the model"
    ((headers, body),) = endpoint.received
    assert headers["authorization"] == f"Bearer {api_key}"
    assert body == {
        "model": "tiny-1", "temperature": 0.5, "max_tokens": 64,
        "messages": [
            {"role": "system", "content": "You are Hermes."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "how are you?"},
        ],
    }  # fmt: skip


async def test_an_endpoint_without_a_key_gets_no_authorization(
    endpoint: FakeEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert await _turn(load_agent(_config(endpoint, api_key_env=None)), "hi", []) is not None
    ((headers, body),) = endpoint.received
    assert "authorization" not in headers
    assert "temperature" not in body


async def test_a_slow_endpoint_gives_the_timeout_reply(
    endpoint: FakeEndpoint, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint.stalled = True
    loaded = load_agent(_config(endpoint, timeout_secs=0.2))
    reply = await _turn(loaded, "hi", [])
    assert reply == f"{ERROR_PREFIX} the model endpoint timed out after 0.2 s."
    assert "did not answer within 0.2 s" in caplog.text


@pytest.mark.parametrize(
    ("status", "body", "reply", "logged"),
    [
        (500, None, "the model endpoint answered HTTP 500.", "answered HTTP 500: "),
        (200, b"not json", "the model endpoint's answer held no text.", "not json"),
        (200, b'{"choices": []}', "the model endpoint's answer held no text.", "choices"),
    ],
)
async def test_a_failing_endpoint_gives_an_error_reply_and_logs_no_key(
    endpoint: FakeEndpoint, api_key: str, caplog: pytest.LogCaptureFixture,
    status: int, body: bytes | None, reply: str, logged: str,
) -> None:  # fmt: skip
    endpoint.status, endpoint.body = status, body
    with caplog.at_level(logging.WARNING, logger="hermes_plugins.agents.openai"):
        assert await _turn(load_agent(_config(endpoint)), "hi", []) == f"{ERROR_PREFIX} {reply}"
    assert logged in caplog.text
    assert api_key not in caplog.text


async def test_an_unreachable_endpoint_gives_an_error_reply(api_key: str) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        gone = FakeEndpoint(url=f"http://127.0.0.1:{closed.getsockname()[1]}/v1")
        reply = await _turn(load_agent(_config(gone)), "hi", [])
    finally:
        closed.close()
    assert reply == f"{ERROR_PREFIX} the model endpoint could not be reached."


def test_a_missing_key_variable_or_model_is_a_named_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MY_MODEL_KEY", raising=False)
    endpoint = FakeEndpoint(url="http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError) as caught:
        load_agent(_config(endpoint, api_key_env="MY_MODEL_KEY"))
    assert caught.value.key == "agent.options.api_key_env"
    assert str(caught.value).startswith(
        "config.yaml: agent.options.api_key_env names MY_MODEL_KEY, which is not set in the "
        "environment; export MY_MODEL_KEY"
    )
    config = GatewayConfig.from_dict({"agent": {"use": "openai"}}, source="config.yaml")
    with pytest.raises(ConfigError, match=r"^config\.yaml: agent\.options\.model is missing; "
                       r"expected the name of a model"):  # fmt: skip
        load_agent(config)
    with pytest.raises(ConfigError, match=r"invalid value for agent\.options\.base_url"):
        load_agent(_config(endpoint, base_url="api.example.com"))


async def test_a_gateway_answers_through_the_openai_agent(
    endpoint: FakeEndpoint, api_key: str, hermes_home: Path
) -> None:
    loaded = load_agent(_config(endpoint))
    assert isinstance(loaded.factory, OpenAIAgents)
    adapter = InMemoryAdapter("telegram")
    config = _config(endpoint)
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), loaded.factory, [adapter])
    async with gateway:
        for text, reply in (("first", "one"), ("second", "two")):
            endpoint.reply = reply
            await gateway.handle_message(MessageEvent(source=telegram_dm("5"), text=text))
            await asyncio.wait_for(gateway.idle(), 10)
    await loaded.aclose()
    assert adapter.texts("5") == ["one", "two"]
    (_, first), (_, second) = endpoint.received
    assert first["messages"][0]["role"] == "system"
    assert "telegram" in first["messages"][0]["content"].lower()  # the session-context prompt
    assert first["messages"][1:] == [{"role": "user", "content": "first"}]
    assert second["messages"][1:] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"},
    ]
