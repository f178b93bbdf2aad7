"""Discord: the guild is never part of the key; channel messages answered in a new thread use
``prospective_thread_id`` (handled by the generic rule). Ids stay raw because mentions need them.
Reads gateway ``MESSAGE_CREATE`` dispatches (:mod:`hermes_plugins.readers.discord`).
"""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, hookimpl
from hermes_plugins.readers.discord import read_discord_message


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``discord`` (no scope component, not PII-safe), with its message reader."""
    return [PlatformSpec(name="discord", read_event=read_discord_message)]
