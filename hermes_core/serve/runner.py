"""``hermes-sessions serve``: the configured platforms' connectors, the agent, the gateway and the
HTTP app, in one process, until SIGTERM or SIGINT, then a drain.

Start-up order keeps the promise that nothing is acknowledged before it is stored: the HTTP port
is bound first (a port in use is an error before anything starts), then the gateway starts
(recovery, owed replies), then the connectors (a poller's first ``getUpdates``), then the app
accepts requests. On the first signal the server stops taking events (pollers finish their
batch, webhooks answer 503 so the platform delivers again later), then the gateway drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import uvicorn

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.connectors import Connector, ConnectorContext
from hermes_core.domain.errors import ConfigError
from hermes_core.domain.models import MessageEvent
from hermes_core.domain.specs import ReadContext
from hermes_core.gateway.agent_loading import LoadedAgent
from hermes_core.gateway.runtime import Gateway
from hermes_core.plugins.events import read_event
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.serve.app import ServeStatus, build_app
from hermes_core.serve.metrics import Metrics

__all__ = ["AppServer", "build_connectors", "serve"]

logger = logging.getLogger(__name__)

METRICS_PLUGIN = "serve_metrics"


class AppServer(uvicorn.Server):
    """uvicorn's server, leaving SIGINT and SIGTERM to its caller (``serve`` stops taking
    events, then drains the gateway, rather than closing at once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_connectors(
    config: GatewayConfig, plugins: HermesPluginManager, environ: Mapping[str, str]
) -> list[Connector]:
    """A connector for each platform the configuration enables; a ``ConfigError`` when none is
    enabled or one has no connector."""
    enabled = config.connected_platforms()
    offered = plugins.connectors()
    if not enabled:
        available = ", ".join(sorted(offered)) or "none"
        raise ConfigError(
            "platforms", "no platform is enabled; set platforms.<name>.enabled: true for the "
            f"platforms to serve (with a connector: {available}).", source=config.source,
        )  # fmt: skip
    connectors = []
    for name in enabled:
        spec = offered.get(name)
        if spec is None:
            available = ", ".join(sorted(offered)) or "none"
            raise ConfigError(
                f"platforms.{name}.enabled", f"platform {name!r} is enabled but no installed "
                f"plugin provides a connector for it (connectors: {available}); install one or "
                f"set platforms.{name}.enabled: false.", source=config.source,
            )  # fmt: skip
        context = ConnectorContext(
            platform=name, settings=config.platforms[name].model_extra or {}, config=config,
            environ=environ, read_event=functools.partial(read_event, name, plugins=plugins),
            read_in_context=functools.partial(_read_in_context, name, plugins),
        )  # fmt: skip
        connectors.append(spec.build(context))
    return connectors


def _read_in_context(
    platform: str, plugins: HermesPluginManager, payload: Mapping[str, Any], context: ReadContext
) -> MessageEvent | None:
    """``read_event`` with the connector's ``ReadContext`` (its cache of the platform's chats)."""
    return read_event(platform, payload, context=context, plugins=plugins)


def _bind(config: GatewayConfig) -> socket.socket:
    """The app's listening socket (``server.port`` 0: a free port)."""
    host, port = config.server.host, config.server.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            "server.host", f"server.host {host!r} cannot be resolved ({exc.strerror}); name an "
            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0.", source=config.source,
        ) from None  # fmt: skip
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            problem = f"port {port} on {host} is in use by another program"
            fix = "stop it or set server.port to a free port (0 picks one)"
        else:
            problem, fix = f"cannot listen on {host}:{port} ({exc.strerror})", "change server"
        raise ConfigError("server.port", f"{problem}; {fix}.", source=config.source) from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    config: GatewayConfig,
    plugins: HermesPluginManager,
    agent: LoadedAgent,
    *,
    environ: Mapping[str, str],
    out: TextIO = sys.stdout,
) -> bool:
    """Serve until SIGTERM or SIGINT; True when the drain finished in time (see
    ``Gateway.stop``). Prints one status line per platform, then ``serving on <url>``; closes
    ``agent`` after the gateway stopped."""
    connectors = build_connectors(config, plugins, environ)
    metrics = Metrics() if config.server.metrics else None
    if metrics is not None and not plugins.has_plugin(METRICS_PLUGIN):
        plugins.register(metrics, name=METRICS_PLUGIN)
    gateway = Gateway(config, plugins, agent.factory, [c.adapter for c in connectors])
    status = ServeStatus()
    app = build_app(gateway, connectors, config, metrics=metrics, status=status)
    sock = _bind(config)
    server = AppServer(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    http: asyncio.Task[None] | None = None
    started: list[Connector] = []

    async def quiesce() -> None:
        status.draining = True
        await _stop_all(started)
        server.should_exit = True
        if http is not None:
            await http
        else:
            sock.close()

    try:
        await gateway.start()
        for connector in connectors:
            await connector.start(gateway)
            started.append(connector)
        http = asyncio.create_task(server.serve(sockets=[sock]))
        await _until_listening(server, http)
        for connector in connectors:
            await gateway.platform_connected(connector.platform)
            _say(out, connector.status())
        _say(out, f"serving on {_url(sock)}")
    except BaseException:
        await quiesce()
        await gateway.stop()
        await agent.aclose()
        raise
    try:
        return await gateway.serve(before_stop=quiesce)
    finally:
        await agent.aclose()


async def _until_listening(server: uvicorn.Server, http: asyncio.Task[None]) -> None:
    while not server.started:
        if http.done():
            http.result()  # its error
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)


async def _stop_all(connectors: Sequence[Connector]) -> None:
    for connector in reversed(connectors):
        try:
            await connector.stop()
        except Exception:
            logger.exception("the %s connector did not stop cleanly", connector.platform)


def _say(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)
