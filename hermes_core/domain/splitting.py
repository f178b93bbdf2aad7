"""Splitting a long reply into parts that fit a platform's message limit.

Every platform caps a message's length, so a connector sends a long reply as several messages.
:func:`split_reply` is pure and shared by every connector, so that all of them cut where a reader
expects a break and keep fenced code blocks renderable in every part.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from hermes_core.domain.errors import InvalidValueError

MIN_LIMIT = 16
"""The smallest ``limit`` that :func:`split_reply` accepts."""

_PARAGRAPH, _LINE, _SENTENCE, _SPACE = 4, 3, 2, 1
"""Cut preferences, best first: a blank line, a line break, a sentence end, a space."""

_WHITESPACE = re.compile(r"\s+")
_OPENING_FENCE = re.compile(r" {0,3}(`{3,})([^`\n]*)")
_CLOSING_FENCE = re.compile(r" {0,3}(`{3,})\s*")
_SENTENCE_ENDS = ".!?\u3002\uff01\uff1f"  # and the CJK full stop, ! and ?
_UNSPACED_SENTENCE_ENDS = re.compile("[\u3002\uff01\uff1f](?=\\S)")
"""CJK sentence ends, which are followed by the next sentence without a space."""
_JOINERS = frozenset("\u200d\ufe0e\ufe0f")


def utf16_len(text: str) -> int:
    """The length of ``text`` in UTF-16 code units, as Telegram counts a message's length: a
    character outside the Basic Multilingual Plane (most emoji) counts as two."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


@dataclass(frozen=True)
class _Block:
    """A fenced code block: offsets into the text and the fence lines that repair a cut."""

    start: int  # the opening fence line
    body: int  # after the opening fence line's line break
    close: int  # the closing fence line (the text's end when the block is never closed)
    end: int  # after the closing fence (trailing spaces excluded)
    reopen: str  # what starts a part that continues the block, e.g. "```python\n"
    closing: str  # what ends a part cut inside the block, e.g. "\n```"
    fits: bool  # the whole block fits in one part: never cut inside
    repairable: bool  # its fences leave room for code: cut at its line breaks, fences repaired


@dataclass(frozen=True)
class _Cut:
    preference: int
    content_end: int  # the part holds the text up to here
    next_start: int  # the next part starts here; what lies between is whitespace, dropped
    closing: str = ""  # appended when the cut is inside a code block


def split_reply(text: str, limit: int, *, measure: Callable[[str], int] = len) -> list[str]:
    """``text`` cut into parts of at most ``limit`` (as counted by ``measure``), to send in order.

    Each part ends at the last place in it where the text reads best as a break: a blank line,
    else a line break, else a sentence end (``.``, ``!``, ``?`` before a space, or the CJK full
    stop, exclamation and question marks),
    else a space, else hard at the limit without separating a character from its combining marks
    or a surrogate pair. A fenced code block (between lines of three backticks) that fits in one
    part is never cut;
    a longer one is cut at its line breaks (inside a line only when one line is too long), the
    part is closed with the block's fence and the next part reopens it with the same info string,
    so every part renders as the text did. (A block whose fence lines would take more than half
    of a part is cut like text.)

    What is kept: the parts are the text's non-whitespace content in order, each exactly as
    written, with nothing repeated. Dropped is only whitespace where a cut falls (the whitespace
    around a cut outside code, from the part's end up to and including the last line break; and
    the one line break replaced by fences inside code) and the text's leading blank lines and
    trailing whitespace. A part never ends with whitespace and never starts with a line break; it
    keeps the indentation of the line it starts with. Text that is empty or only whitespace gives
    ``[]``: there is nothing to send.

    ``measure`` must count every non-empty string as at least 1 and never less for a longer one;
    Telegram counts UTF-16 code units, so pass :func:`utf16_len` there. Raises
    :class:`~hermes_core.domain.errors.InvalidValueError` when ``limit`` is below
    :data:`MIN_LIMIT`.
    """
    if limit < MIN_LIMIT:
        raise InvalidValueError(
            "limit",
            f"A reply cannot be split into parts of {limit} characters: pass the platform's "
            f"message limit, at least {MIN_LIMIT}.",
        )
    leading = _WHITESPACE.match(text)
    pos = 0 if leading is None else text.rfind("\n", 0, leading.end()) + 1
    blocks = _blocks(text, limit, measure)
    parts: list[str] = []
    while True:
        inside = _continued_block(blocks, pos)
        prefix = "" if inside is None else inside.reopen
        rest = text[pos:].rstrip()
        if not rest:
            return parts
        if measure(prefix + rest) <= limit:
            parts.append(prefix + rest)
            return parts
        cut = _best_cut(text, pos, prefix, blocks, limit, measure)
        parts.append(prefix + text[pos : cut.content_end] + cut.closing)
        pos = cut.next_start


def _blocks(text: str, limit: int, measure: Callable[[str], int]) -> list[_Block]:
    """The text's fenced code blocks, read line by line as CommonMark reads backtick fences."""
    blocks: list[_Block] = []
    opening: tuple[int, int, str, str] | None = None  # start, body, marker, info
    pos = 0
    while pos < len(text):
        newline = text.find("\n", pos)
        line_end = len(text) if newline < 0 else newline
        line = text[pos:line_end]
        if opening is None:
            match = _OPENING_FENCE.fullmatch(line)
            if match is not None:
                opening = (pos, min(line_end + 1, len(text)), match[1], match[2].strip())
        else:
            match = _CLOSING_FENCE.fullmatch(line)
            if match is not None and len(match[1]) >= len(opening[2]):
                end = pos + len(line.rstrip())
                blocks.append(_block(text, opening, pos, end, limit, measure))
                opening = None
        pos = line_end + 1
    if opening is not None:
        blocks.append(_block(text, opening, len(text), len(text), limit, measure))
    return blocks


def _block(
    text: str,
    opening: tuple[int, int, str, str],
    close: int,
    end: int,
    limit: int,
    measure: Callable[[str], int],
) -> _Block:
    start, body, marker, info = opening
    closing = "\n" + marker
    return _Block(
        start=start,
        body=body,
        close=close,
        end=end,
        reopen=f"{marker}{info}\n",
        closing=closing,
        fits=measure(text[start:end]) <= limit,
        # fences taking over half of every part would leave too little room for the code
        repairable=measure(text[start:body] + closing) <= limit // 2,
    )


def _continued_block(blocks: list[_Block], pos: int) -> _Block | None:
    """The code block that a part starting at ``pos`` continues (its fence to reopen), or None."""
    for block in blocks:
        if block.repairable and block.body <= pos < block.close:
            return block
    return None


def _best_cut(
    text: str,
    pos: int,
    prefix: str,
    blocks: list[_Block],
    limit: int,
    measure: Callable[[str], int],
) -> _Cut:
    """Where the part starting at ``pos`` ends, when the rest of the text does not fit."""
    plain_end = _fitting_end(text, pos, prefix, "", limit, measure)
    protected = [b for b in blocks if b.fits or b.repairable]
    cuts = [
        cut
        for cut in _prose_cuts(text, pos, plain_end)
        if not any(b.start < cut.content_end < b.end for b in protected)
    ]
    hard: _Cut | None = None
    for block in blocks:
        if block.fits or not block.repairable or block.close <= pos or block.start > plain_end:
            continue
        code_end = _fitting_end(text, pos, prefix, block.closing, limit, measure)
        floor = max(pos, block.body)
        newline = text.rfind("\n", floor + 1, min(block.close - 1, code_end + 1))
        if newline > floor:
            cuts.append(_Cut(_LINE, newline, newline + 1, block.closing))
        elif hard is None:  # one code line longer than a part: cut inside it
            end = _safe_end(text, min(code_end, block.close - 1), floor)
            if end > floor:
                hard = _Cut(0, end, end, block.closing)
    if cuts:
        return max(cuts, key=lambda cut: (cut.preference, cut.content_end))
    if hard is not None:
        return hard
    end = _safe_end(text, plain_end, pos)
    return _Cut(0, end, end)


def _prose_cuts(text: str, pos: int, end: int) -> list[_Cut]:
    """Every cut whose part would end after ``pos`` and by ``end``, outside code blocks or not."""
    cuts: list[_Cut] = []
    for match in _WHITESPACE.finditer(text, pos):
        space, after = match.span()
        if space > end:
            break
        if space == pos:
            continue  # the indentation the part starts with
        newlines = text.count("\n", space, after)
        if newlines:
            start = text.rfind("\n", space, after) + 1
            cuts.append(_Cut(_PARAGRAPH if newlines > 1 else _LINE, space, start))
        else:
            sentence = text[space - 1] in _SENTENCE_ENDS
            cuts.append(_Cut(_SENTENCE if sentence else _SPACE, space, after))
    for match in _UNSPACED_SENTENCE_ENDS.finditer(text, pos, end):
        cuts.append(_Cut(_SENTENCE, match.end(), match.end()))
    return cuts


def _fitting_end(
    text: str, pos: int, prefix: str, suffix: str, limit: int, measure: Callable[[str], int]
) -> int:
    """The largest end such that ``prefix + text[pos:end] + suffix`` measures at most ``limit``."""
    low, high = pos, min(len(text), pos + limit)
    while low < high:
        middle = (low + high + 1) // 2
        if measure(prefix + text[pos:middle] + suffix) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def _safe_end(text: str, end: int, floor: int) -> int:
    """``end`` moved back so that it does not split a character: a surrogate pair, a base and its
    combining marks, a zero-width joiner or variation selector and its neighbours. Back at
    ``floor`` (one unbroken cluster longer than a part), ``end`` as it was."""
    cut = end
    while cut > floor and cut < len(text) and _joined(text[cut - 1], text[cut]):
        cut -= 1
    return end if cut <= floor else cut


def _joined(before: str, after: str) -> bool:
    return (
        ("\ud800" <= before <= "\udbff" and "\udc00" <= after <= "\udfff")
        or unicodedata.combining(after) != 0
        or after in _JOINERS
        or before == "\u200d"
    )
