"""Built-in platforms that follow the generic key rule with nothing specific to add."""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, hookimpl


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """``local`` (the CLI terminal), ``signal``, ``matrix``, ``email``, ``sms``, ``bluebubbles``."""
    return [
        PlatformSpec(name="local", local_machine=True, describe=lambda source: "CLI terminal"),
        PlatformSpec(name="signal", pii_safe=True),
        PlatformSpec(name="matrix"),
        PlatformSpec(name="email"),
        PlatformSpec(name="sms"),
        PlatformSpec(name="bluebubbles", pii_safe=True),
    ]
