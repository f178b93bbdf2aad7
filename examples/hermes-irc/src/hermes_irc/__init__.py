"""Example third-party plugin: the IRC platform for hermes-sessions.

Registered through the ``hermes.plugins`` entry point ``irc = "hermes_irc"``.
"""

from __future__ import annotations

from hermes_core import GatewayConfig, PlatformSpec, SessionSource, hookimpl

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
