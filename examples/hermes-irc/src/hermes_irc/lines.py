"""IRC protocol lines (RFC 1459 / RFC 2812): reading one, and writing a reply as PRIVMSG lines.

A line is at most 512 bytes with its CRLF, and the server relays a PRIVMSG with the sender's
``:nick!user@host`` prefix in front, so a reply is cut into lines well under that limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hermes_core import split_reply

__all__ = ["CHANNEL_PREFIXES", "MAX_LINE_BYTES", "Line", "parse_line", "privmsg_lines"]

MAX_LINE_BYTES = 400
"""The longest ``PRIVMSG <target> :<text>`` line sent (CRLF excluded): 512 bytes less room for
the ``:nick!user@host`` prefix the server puts in front when it relays the line."""
CHANNEL_PREFIXES = "#&+!"
"""What a channel name starts with; any other target is a nickname."""


@dataclass(frozen=True)
class Line:
    """One line from the server: ``:prefix COMMAND param ... :trailing``."""

    prefix: str
    command: str
    params: tuple[str, ...]

    @property
    def nick(self) -> str:
        """The sender's nickname (the prefix up to ``!``)."""
        return self.prefix.split("!", 1)[0]


def parse_line(raw: str) -> Line | None:
    """The parsed line, None when it is blank. Message tags (``@...``) are skipped."""
    text = raw.rstrip("\r\n")
    if text.startswith("@"):
        text = text.partition(" ")[2]
    prefix = ""
    if text.startswith(":"):
        prefix, _, text = text[1:].partition(" ")
    head, found, trailing = text.partition(" :")
    words = head.split()
    if not words:
        return None
    params = (*words[1:], trailing) if found else tuple(words[1:])
    return Line(prefix, words[0].upper(), params)


def privmsg_lines(target: str, text: str, command: str = "PRIVMSG") -> list[str]:
    """``text`` to ``target`` as protocol lines (without CRLF): one per line of the text (blank
    lines dropped: IRC has no empty message), each cut with :func:`hermes_core.split_reply` so
    that the whole line stays within :data:`MAX_LINE_BYTES` bytes of UTF-8."""
    head = f"{command} {target} :"
    room = MAX_LINE_BYTES - len(head.encode("utf-8"))
    lines: list[str] = []
    for line in text.replace("\0", "").splitlines():
        if line.strip():
            parts = split_reply(line, room, measure=lambda part: len(part.encode("utf-8")))
            lines.extend(head + part for part in parts)
    return lines
