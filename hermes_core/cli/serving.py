"""``hermes-sessions serve``: run the configured platforms' connectors, the agent and the HTTP
app (webhooks, health, metrics) until SIGTERM or SIGINT (see :mod:`hermes_core.serve`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
from typing import Any

from hermes_core.cli.console import agent_argument
from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import HermesError
from hermes_core.gateway.agent_loading import load_agent
from hermes_core.plugins.manager import create_plugin_manager

SERVE_MODULES = ("httpx", "starlette", "uvicorn", "prometheus_client")
"""What ``serve`` needs beyond the core: the ``serve`` extra."""


class MissingExtraError(HermesError):
    """``serve`` needs packages of the ``serve`` extra that are not installed."""


def register(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``serve``."""
    serve = commands.add_parser(
        "serve", parents=[*parents, agent_argument()], allow_abbrev=False,
        help="run the enabled platforms' connectors, the agent and the HTTP app (webhooks, "
        "/healthz, /readyz, /metrics) until SIGTERM or SIGINT",
    )  # fmt: skip
    serve.set_defaults(handler=serve_command, creates_state_dir=True)


def serve_command(args: argparse.Namespace, config: GatewayConfig) -> int:
    """Serve until a signal; exit 0 when the drain finished, 1 when turns were left to resume."""
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"serve needs {', '.join(missing)}, which are not installed; install the serve "
            "extra: pip install 'hermes-sessions[serve]'."
        )
    from hermes_core.serve.runner import serve  # the serve extra's imports

    agent = load_agent(config, args.agent)
    plugins = create_plugin_manager(config)
    drained = asyncio.run(serve(config, plugins, agent, environ=os.environ))
    print("stopped" if drained else "stopped; the turns left running resume at the next start")
    return 0 if drained else 1
