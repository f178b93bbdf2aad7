"""Telegram: the generic key rule (forum topics are threads); ids may be pseudonymised."""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, hookimpl


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``telegram`` as PII-safe."""
    return [PlatformSpec(name="telegram", pii_safe=True)]
