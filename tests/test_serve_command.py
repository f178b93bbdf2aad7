"""``hermes-sessions serve``: one-line errors for what a user gets wrong, and a whole run of the
runner (a real socket, a connector, the gateway) ended by SIGTERM: the connector stops taking
events before the gateway drains."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
from pathlib import Path

import httpx
import pytest
from support.hook_connector import HookConnector

from hermes_core import ConfigError, ConnectorSpec, GatewayConfig, create_plugin_manager, hookimpl
from hermes_core.cli.main import main
from hermes_core.gateway.agent_loading import LoadedAgent
from hermes_core.gateway.agents import EchoAgent
from hermes_core.serve.runner import serve

ECHO = LoadedAgent("echo", lambda entry: EchoAgent())


class _HookPlugin:
    def __init__(self) -> None:
        self.built: list[HookConnector] = []

    def _build(self, context: object) -> HookConnector:
        connector = HookConnector()
        self.built.append(connector)
        return connector

    @hookimpl
    def hermes_register_connectors(self, config: GatewayConfig) -> list[ConnectorSpec]:
        return [ConnectorSpec(platform="matrix", build=self._build)]


def _config(home: Path, port: int = 0, **platforms: dict[str, object]) -> GatewayConfig:
    data = {"platforms": platforms, "server": {"port": port}}
    return GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(home)})


def _serve_cli(home: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    (home / "config.yaml").write_text(text)
    status = main(["--state-dir", str(home), "serve"])
    return status, capsys.readouterr().err.strip()


def test_serve_without_an_enabled_platform_says_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, error = _serve_cli(tmp_path, "server: {port: 0}\n", capsys)
    assert status == 2
    assert error.startswith("hermes-sessions: error: ")
    assert "no platform is enabled; set platforms.<name>.enabled: true" in error
    assert len(error.splitlines()) == 1


def test_serve_names_an_enabled_platform_without_a_connector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, error = _serve_cli(tmp_path, "platforms: {matrix: {enabled: true}}\n", capsys)
    assert status == 2
    assert "platform 'matrix' is enabled but no installed plugin provides a connector" in error
    assert "platforms.matrix.enabled: false" in error


async def test_a_port_in_use_is_an_error_before_anything_starts(hermes_home: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(hermes_home, port, matrix={"enabled": True})
        plugins = create_plugin_manager(config)
        plugins.register(_HookPlugin(), name="hook")
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is in use"):
            await serve(config, plugins, ECHO, environ={})
    assert not (hermes_home / "sessions" / "state.db").exists()


async def _line(out: io.StringIO, prefix: str) -> str:
    for _ in range(1000):
        for line in out.getvalue().splitlines():
            if line.startswith(prefix):
                return line
        await asyncio.sleep(0.01)
    raise AssertionError(f"no line starting with {prefix!r} in {out.getvalue()!r}")


async def test_serve_answers_then_stops_taking_events_and_drains_on_sigterm(
    hermes_home: Path,
) -> None:
    config = _config(hermes_home, matrix={"enabled": True})
    plugins = create_plugin_manager(config)
    hook = _HookPlugin()
    plugins.register(hook, name="hook")
    out = io.StringIO()
    serving = asyncio.create_task(serve(config, plugins, ECHO, environ={}, out=out))
    url = (await _line(out, "serving on ")).removeprefix("serving on ")
    assert out.getvalue().splitlines()[0] == "matrix: webhook /matrix"
    (connector,) = hook.built
    async with httpx.AsyncClient() as client:
        body = {"chat": "7", "text": "hi", "id": "m1"}
        assert (await client.post(f"{url}/matrix", json=body)).status_code == 200
        for _ in range(500):
            if connector.adapter.sent:
                break
            await asyncio.sleep(0.01)
        assert connector.adapter.texts("7") == ["echo: hi"]
        assert (await client.get(f"{url}/metrics")).status_code == 200
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(serving, 30) is True
        assert connector.inbox is None  # stopped before the drain
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/healthz")
