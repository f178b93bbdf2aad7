"""Example third-party plugin: the IRC platform for hermes-sessions.

Registered through the ``hermes.plugins`` entry point ``irc = "hermes_irc"``. Besides the
platform's key rule it offers a connector (:mod:`hermes_irc.connector`), registered with the same
hook a built-in connector uses and imported only when ``hermes-sessions serve`` builds it.
"""

from __future__ import annotations

from typing import Any

from hermes_core import (
    ConnectorContext,
    ConnectorSpec,
    GatewayConfig,
    PlatformSpec,
    SessionSource,
    hookimpl,
)

# RFC 1459 case mapping: besides ASCII letters, []\~ are the upper case of {}|^.
_RFC1459_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ[]\\~", "abcdefghijklmnopqrstuvwxyz{}|^")


def irc_casefold(nick: str) -> str:
    """The canonical form of a nickname: IRC compares nicknames case-insensitively."""
    return nick.strip().translate(_RFC1459_LOWER)


def network_scope(source: SessionSource) -> str | None:
    """The IRC network is the scope: one channel name on two networks is two conversations."""
    return source.scope_id


@hookimpl
def hermes_register_platforms(config: GatewayConfig) -> list[PlatformSpec]:
    """Register ``irc``: network scope, case-insensitive nicknames, ids kept raw in prompts."""
    return [
        PlatformSpec(
            name="irc",
            label="IRC",
            scope=network_scope,
            canonical_dm_chat_id=irc_casefold,
            canonical_participant=irc_casefold,
        )
    ]


def build_connector(context: ConnectorContext) -> Any:
    """The IRC connector of ``platforms.irc`` (its module is imported only now)."""
    from hermes_irc.connector import build_irc

    return build_irc(context)


@hookimpl
def hermes_register_connectors(config: GatewayConfig) -> list[ConnectorSpec]:
    """Register the IRC client connector."""
    summary = "IRC: one client connection joining platforms.irc.channels; replies as PRIVMSG"
    return [ConnectorSpec(platform="irc", build=build_connector, summary=summary)]
