"""Slack: the workspace (``scope_id``) is a key component when set, so channels with the same id
in two workspaces never share a session. Reads Events API ``event_callback`` payloads
(:mod:`hermes_plugins.readers.slack`). Its connector (the Events API over HTTP, replies with
``chat.postMessage``) is :mod:`hermes_plugins.connectors.slack`, imported only when built.
"""

from __future__ import annotations

from hermes_core import (
    ConnectorSpec,
    GatewayConfig,
    PlatformSpec,
    SessionSource,
    hookimpl,
)
from hermes_plugins.connectors import lazy_connector
from hermes_plugins.readers.slack import read_slack_event


def workspace_scope(source: SessionSource) -> str | None:
    """The workspace id as the key's scope component."""
    return source.scope_id


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``slack`` with its workspace scope (not PII-safe) and its event reader."""
    return [PlatformSpec(name="slack", scope=workspace_scope, read_event=read_slack_event)]


@hookimpl
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Register the Slack connector: Events API requests in, ``chat.postMessage`` out."""
    summary = "Slack Events API over HTTP (signed requests), replies with chat.postMessage"
    return [lazy_connector("slack", "slack:build", summary)]
