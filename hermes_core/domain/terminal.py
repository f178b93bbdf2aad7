"""Text written for an operator to read on a terminal: chat text is a user's, so what reaches the
terminal must show it, never run it (no escape sequence that sets a window title, clears the
screen or colours the output, no bidi override that reverses what follows)."""

from __future__ import annotations

import re

_CONTROLS = (
    *range(0x00, 0x20), 0x7F, *range(0x80, 0xA0),  # C0 (ESC included), DEL, C1 (CSI, OSC, ...)
    *range(0x202A, 0x202F), *range(0x2066, 0x206A),  # bidi embeddings, overrides and isolates
)  # fmt: skip
_TEXT_ESCAPES = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" for code in _CONTROLS}
_LINES_ESCAPES = {code: escape for code, escape in _TEXT_ESCAPES.items() if code not in (9, 10)}
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in _CONTROLS if code >= 0x7F}
"""JSON escapes C0 itself; the others are written as ``\\u`` and four hex digits, which parses to
the same text."""
_JSON_STEERING = re.compile("[" + "".join(map(chr, _JSON_ESCAPES)) + "]")
"""Any character of :data:`_JSON_ESCAPES` (most text has none: one search, no translation)."""


def safe_text(text: str, *, keep_lines: bool = False) -> str:
    """``text`` with every character that steers a terminal written as a visible escape
    (``\\x1b``, ``\\u202e``): C0 and C1 controls (ESC, so no colour, title or screen-clearing
    sequence), DEL and the bidi overrides and isolates that reverse text. Chat text is a user's:
    what an operator reads must show it, never run it. ``keep_lines`` keeps newlines and tabs
    (a Markdown file), else each value stays on its line."""
    return text.translate(_LINES_ESCAPES if keep_lines else _TEXT_ESCAPES)


def inert_json(text: str) -> str:
    """JSON text (as ``json.dumps(..., ensure_ascii=False)`` writes it, C0 escaped already)
    with the C1 controls, DEL and bidi overrides in it written as ``\\u`` escapes too: parsed,
    it is the same data."""
    if text.isascii() and "\x7f" not in text:  # DEL is the one ASCII character to escape
        return text
    return text.translate(_JSON_ESCAPES) if _JSON_STEERING.search(text) else text
