"""split_reply: where a long reply is cut, what is kept, and fenced code blocks in every part."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hermes_core import InvalidValueError, split_reply, utf16_len
from hermes_core.domain.splitting import MIN_LIMIT

FENCE = "```"


@pytest.mark.parametrize(
    ("text", "limit", "parts"),
    [
        pytest.param("", 16, [], id="empty: nothing to send"),
        pytest.param(" \n\t\n  ", 16, [], id="whitespace only: nothing to send"),
        pytest.param("\n\n  short  \n", 16, ["  short"], id="fits: blank lines and tail dropped"),
        pytest.param(
            "One two. Three\nfour five\n\nsix seven",
            30,
            ["One two. Three\nfour five", "six seven"],
            id="a blank line before a line break",
        ),
        pytest.param(
            "One two. Three four\nfive six seven",
            24,
            ["One two. Three four", "five six seven"],
            id="a line break before a sentence end",
        ),
        pytest.param(
            "One two. Three four five six",
            20,
            ["One two.", "Three four five six"],
            id="a sentence end before a space",
        ),
        pytest.param("Why not? Sure!  Yes", 16, ["Why not? Sure!", "Yes"], id="? and !"),
        pytest.param(
            "一二三四五六七。八九十一二三四五六七",
            16,
            ["一二三四五六七。", "八九十一二三四五六七"],
            id="CJK sentence end without a space",
        ),
        pytest.param("alpha beta gamma delta", 16, ["alpha beta gamma", "delta"], id="a space"),
        pytest.param("a" * 20, 16, ["a" * 16, "a" * 4], id="hard at the limit"),
        pytest.param(
            "a" * 15 + "e\u0301xyz",
            16,
            ["a" * 15, "e\u0301xyz"],
            id="hard cut keeps a combining mark with its letter",
        ),
        pytest.param(
            "intro\n  - item one\n  - item two",
            20,
            ["intro\n  - item one", "  - item two"],
            id="a part keeps its first line's indentation",
        ),
    ],
)
def test_cuts_where_the_text_reads_best(text: str, limit: int, parts: list[str]) -> None:
    assert split_reply(text, limit) == parts


def test_a_code_block_that_fits_moves_whole_to_the_next_part() -> None:
    code = f"{FENCE}py\nx = 1\ny = 2\n{FENCE}"
    text = f"Some words before it\n{code}\nafter"
    assert len(code) == 21
    assert split_reply(text, 22) == ["Some words before it", code, "after"]


def test_a_long_code_block_is_cut_at_line_breaks_and_its_fence_repaired() -> None:
    lines = [f"print({i})" for i in range(6)]
    text = "Look:\n" + FENCE + "python\n" + "\n".join(lines) + "\n" + FENCE + "\nDone."
    assert split_reply(text, 44) == [
        "Look:\n```python\nprint(0)\nprint(1)\n```",
        "```python\nprint(2)\nprint(3)\nprint(4)\n```",
        "```python\nprint(5)\n```\nDone.",
    ]


def test_blank_lines_and_indentation_inside_code_are_kept() -> None:
    text = FENCE + "\ndef f():\n\n    return 1\n\n\n    pass\n" + FENCE
    parts = split_reply(text, 24)
    assert parts == ["```\ndef f():\n\n```", "```\n    return 1\n\n\n```", "```\n    pass\n```"]


def test_one_code_line_longer_than_a_part_is_cut_inside_it() -> None:
    text = FENCE + "\n" + "x" * 30 + "\n" + FENCE
    parts = split_reply(text, 20)
    assert parts == ["```\n" + "x" * 12 + "\n```", "```\n" + "x" * 12 + "\n```", "```\nxxxxxx\n```"]


def test_telegram_counts_utf16_code_units() -> None:
    assert utf16_len("a😀é") == 4
    assert utf16_len("\ud83d\ude00") == 2  # a surrogate pair held as two code points
    text = "😀" * 10
    assert split_reply(text, 16) == [text]
    assert split_reply(text, 16, measure=utf16_len) == ["😀" * 8, "😀" * 2]


def test_a_surrogate_pair_is_never_separated() -> None:
    text = "a" + "\ud83d\ude00" * 10
    assert split_reply(text, 16) == ["a" + "\ud83d\ude00" * 7, "\ud83d\ude00" * 3]


@pytest.mark.parametrize("limit", [-1, 0, MIN_LIMIT - 1])
def test_a_limit_too_small_is_refused_with_what_to_change(limit: int) -> None:
    with pytest.raises(InvalidValueError, match="pass the platform's message limit, at least 16"):
        split_reply("hello", limit)


# -- properties ----------------------------------------------------------------------------------

_REOPENED = re.compile(r"\A`{3,}[^`\n]*\n")
_CLOSED = re.compile(r"\n`{3,}\Z")


def _reassembly(parts: list[str]) -> re.Pattern[str]:
    """What the text must be: the parts in order with only whitespace between them, except that
    between a part closed with a fence and the next reopening it the fences may have been added
    in place of one line break (or of nothing, when a code line was cut)."""
    # length of the reopening line each part starts with, of the closing fence each ends with
    heads = [len(m[0]) if (m := _REOPENED.match(part)) else 0 for part in parts]
    tails = [len(m[0]) if (m := _CLOSED.search(part)) else 0 for part in parts]
    pattern = r"\s*"
    tail_from = 0  # where the previous part's closing fence starts, past what its body matched
    for i, part in enumerate(parts):
        repaired = i > 0 and heads[i] > 0 and tails[i - 1] > 0
        if repaired:
            fences = re.escape(parts[i - 1][tail_from:]) + r"\s*" + re.escape(part[: heads[i]])
            pattern += f"(?:{fences}|\\n?)"
        elif i:
            pattern += r"\s*"
        start = heads[i] if repaired else 0
        end = (
            len(part) - tails[i] if i + 1 < len(parts) and tails[i] and heads[i + 1] else len(part)
        )
        # an empty block (```python\n```) shares its line break between its two fences
        tail_from = max(end, start)
        pattern += re.escape(part[start:tail_from])
    return re.compile(pattern + r"\s*")


def _open_fence_at_end(part: str) -> bool:
    marker: str | None = None
    for line in part.split("\n"):
        if marker is None:
            opening = re.fullmatch(r" {0,3}(`{3,})[^`]*", line)
            marker = opening[1] if opening else None
        elif re.fullmatch(r" {0,3}(`{3,})\s*", line) and len(line.strip()) >= len(marker):
            marker = None
    return marker is not None


MEASURES: list[Callable[[str], int]] = [len, utf16_len]
any_text = st.text(alphabet=st.sampled_from(list("ab .!?\n\t`。é\u0301😀")), max_size=300)
words = st.text(alphabet=st.sampled_from(list("abcdef😀é")), min_size=1, max_size=12)
sentence = st.lists(words, min_size=1, max_size=8).map(" ".join).map(lambda s: s + ". ")
paragraph = st.lists(sentence, min_size=1, max_size=5).map("".join)
code_line = st.text(alphabet=st.sampled_from(list("x = (1) ")), max_size=40)
code_block = st.tuples(st.sampled_from(["", "python", "js"]), st.lists(code_line, max_size=12)).map(
    lambda block: "\n".join([FENCE + block[0], *block[1], FENCE])
)
markdown = st.lists(st.one_of(paragraph, code_block), max_size=8).map("\n\n".join)


@settings(max_examples=300, deadline=None)
@given(any_text, st.integers(MIN_LIMIT, 60), st.sampled_from(MEASURES))
def test_every_part_fits_and_the_text_is_kept(
    text: str, limit: int, measure: Callable[[str], int]
) -> None:
    parts = split_reply(text, limit, measure=measure)
    assert all(measure(part) <= limit for part in parts)
    assert all(part.strip() and not part[-1].isspace() for part in parts)
    assert all(not part.startswith("\n") for part in parts)
    assert _reassembly(parts).fullmatch(text), parts
    assert (parts == []) == (text.strip() == "")


@settings(max_examples=300, deadline=None)
@given(markdown, st.integers(32, 120), st.sampled_from(MEASURES))
@example(  # an empty block between two others: its fences share one line break
    "```\n\n1111\n1111\n```\n\n```python\n```\n\n```\n\n\n11111111\n```", 32, len
)
def test_every_part_of_balanced_markdown_has_balanced_fences(
    text: str, limit: int, measure: Callable[[str], int]
) -> None:
    """From 32 on, the fences of ```python take at most half of a part, so they are repaired."""
    parts = split_reply(text, limit, measure=measure)
    assert all(measure(part) <= limit for part in parts)
    assert not any(_open_fence_at_end(part) for part in parts), parts
    assert _reassembly(parts).fullmatch(text), parts


@settings(max_examples=200, deadline=None)
@given(st.lists(code_block, min_size=1, max_size=4), st.integers(MIN_LIMIT, 120))
def test_a_code_block_that_fits_is_never_cut(blocks: list[str], limit: int) -> None:
    text = "\n\n".join(blocks)
    parts = split_reply(text, limit)
    for block in blocks:
        if len(block) <= limit:
            assert any(block in part for part in parts)
