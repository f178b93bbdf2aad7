"""Discord: the guild is never part of the key; channel messages answered in a new thread use
``prospective_thread_id`` (handled by the generic rule). Ids stay raw because mentions need them.
Reads gateway ``MESSAGE_CREATE`` dispatches (:mod:`hermes_plugins.readers.discord`). Its
connector (the gateway websocket in, REST out) is :mod:`hermes_plugins.connectors.discord`,
imported only when built.
"""

from __future__ import annotations

from hermes_core import ConnectorSpec, GatewayConfig, PlatformSpec, hookimpl
from hermes_plugins.connectors import lazy_connector
from hermes_plugins.readers.discord import read_discord_message


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``discord`` (no scope component, not PII-safe), with its message reader."""
    return [PlatformSpec(name="discord", read_event=read_discord_message)]


@hookimpl
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Register the Discord connector: the gateway websocket in, REST out."""
    summary = "Discord gateway websocket (read back over REST after a restart), replies over REST"
    return [lazy_connector("discord", "discord:build", summary)]
