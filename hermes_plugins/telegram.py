"""Telegram: the generic key rule (forum topics are threads); ids may be pseudonymised; reads
Bot API ``Update`` objects (:mod:`hermes_plugins.readers.telegram`)."""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, hookimpl
from hermes_plugins.readers.telegram import read_telegram_update


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``telegram`` as PII-safe, with its ``Update`` reader."""
    return [PlatformSpec(name="telegram", pii_safe=True, read_event=read_telegram_update)]
