"""Discord: the guild is never part of the key; channel messages answered in a new thread use
``prospective_thread_id`` (handled by the generic rule). Ids stay raw because mentions need them.
"""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, hookimpl


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``discord`` (no scope component, not PII-safe)."""
    return [PlatformSpec(name="discord")]
