"""Telegram: the generic key rule (forum topics are threads, a forum's General topic is thread
``1``); ids may be pseudonymised; reads Bot API ``Update`` objects
(:mod:`hermes_plugins.readers.telegram`); connects through the Bot API
(:mod:`hermes_plugins.connectors.telegram`, imported only when built: it needs the ``serve``
extra)."""

from __future__ import annotations

from hermes_core import ConnectorSpec, GatewayConfig, PlatformSpec, hookimpl
from hermes_plugins.connectors import lazy_connector
from hermes_plugins.readers.telegram import GENERAL_TOPIC, read_telegram_update


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``telegram`` as PII-safe, with its ``Update`` reader and a forum's General topic
    (where the reader puts a forum's messages outside any topic)."""
    spec = PlatformSpec(
        name="telegram", pii_safe=True, read_event=read_telegram_update,
        forum_general_thread=GENERAL_TOPIC,
    )  # fmt: skip
    return [spec]


@hookimpl
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Register the Telegram Bot API connector (long polling or a webhook)."""
    summary = "Telegram Bot API: getUpdates long polling or a webhook; replies with sendMessage"
    return [lazy_connector("telegram", "telegram:build_telegram", summary)]
