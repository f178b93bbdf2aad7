"""Reading a command from a message's text: the first word, any case, addressed or not."""

from __future__ import annotations

from collections.abc import Sequence


def parse_command(
    text: str, names: Sequence[str], *, bot_username: str | None, direct: bool
) -> tuple[str | None, str]:
    """The command a message starts with (first token, any case) and the rest of its text.

    A command addressed as ``/cmd@name`` counts only when it is addressed to this bot: ``name``
    equals ``bot_username`` (any case, as Telegram user names are), or, with no
    ``bot_username`` known, in a direct chat (``direct``), where no other bot can be meant. In a
    group it may be meant for another bot, so it stays ordinary text."""
    parts = text.strip().split(maxsplit=1)
    if not parts:
        return None, ""
    word, at, name = parts[0].partition("@")
    rest = parts[1] if len(parts) > 1 else ""
    if at and not (name.casefold() == bot_username.casefold() if bot_username else direct):
        return None, rest
    word = word.lower()
    return (word if word in names else None), rest
