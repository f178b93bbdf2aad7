"""A real Gateway (SQLite under the test's home) with one connector built and started as
``hermes-sessions serve`` builds and starts it, for the connector tests: optionally the HTTP app
served on the loopback interface, and waits that are deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TypeVar

from hermes_core import (
    Agent,
    Connector,
    EchoAgent,
    Gateway,
    GatewayConfig,
    HermesPluginManager,
    TurnRequest,
)
from hermes_core.serve.app import build_app
from hermes_core.serve.runner import build_connectors
from support.loopback import served_here

WAIT_SECS = 10.0

C = TypeVar("C", bound=Connector)


def build_one(
    config: GatewayConfig, plugins: HermesPluginManager, environ: Mapping[str, str], kind: type[C]
) -> C:
    """The one connector ``serve`` builds for ``config`` (through the registered spec), of
    ``kind``."""
    (connector,) = build_connectors(config, plugins, environ)
    assert isinstance(connector, kind), connector
    return connector


@asynccontextmanager
async def connector_serving(
    config: GatewayConfig,
    plugins: HermesPluginManager,
    connector: Connector,
    agent: Callable[[], Agent] = EchoAgent,
) -> AsyncIterator[Gateway]:
    """The started gateway (each session's agent from ``agent``) with ``connector`` started into
    it; the connector is stopped before the gateway."""
    async with Gateway(config, plugins, lambda entry: agent(), [connector.adapter]) as gateway:
        await connector.start(gateway)
        try:
            yield gateway
        finally:
            await connector.stop()


@asynccontextmanager
async def app_served(
    gateway: Gateway, connector: Connector, config: GatewayConfig
) -> AsyncIterator[str]:
    """The base URL of ``serve``'s HTTP app for ``connector``, served on 127.0.0.1."""
    async with served_here(build_app(gateway, [connector], config)) as url:
        yield url


async def until(condition: Callable[[], bool], secs: float = WAIT_SECS) -> None:
    """Wait for ``condition``; an ``AssertionError`` when the deadline passes first."""
    deadline = time.monotonic() + secs
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


class LongAgent(EchoAgent):
    """Answers with ``text``, whatever it heard."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    async def run_turn(self, request: TurnRequest) -> str | None:
        return self.text
