"""Streamed replies: a reply shown while the agent writes it, one message edited in place, and
continued in a new message when it outgrows the platform's limit.

What the store knows, so that a crash never leaves a half message without a note nor the whole
reply twice: from the turn's start (the commit that sets its marker), the lane's metadata says a
streamed reply is under way (:data:`STREAM_METADATA`, an empty layout); once the platform
answers, the id of each message posted and where in the reply it starts. The finished reply is
then stored and recorded in the delivery ledger like any reply, its row taking the messages over
and the lane's record dropped in the same commit; its delivery is the last edit. After a crash:

- the reply was stored (its ledger row is owed): the messages are edited into it, the last one
  marked as recovered (the boot sweep or the reconnect sends it, :func:`render`);
- it was not: the lane's next turn (its resume, or the next message) first edits the first
  message to say the reply was interrupted (:data:`INTERRUPTED_NOTE`) and the others to
  :data:`CUT_PART`, then runs.

Text that could still become a silence marker is held back (SPEC §7.6): a reply that ends as
silence posts nothing, and its silence notice goes out as a plain reply.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hermes_core.domain.models import SessionSource
from hermes_core.domain.text import clean_text
from hermes_core.gateway.agents import EditingAdapter
from hermes_core.store.backend import STREAM_METADATA
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.ledger import SendResult, could_become_silent

__all__ = [
    "CUT_PART", "INTERRUPTED_NOTE", "RECOVERED_NOTE", "STREAM_METADATA", "Commit", "Layout",
    "Streamer", "render",
]  # fmt: skip

logger = logging.getLogger(__name__)

INTERRUPTED_NOTE = "⚠️ This reply was interrupted when the gateway restarted; the turn runs again."
"""What the first message of a cut stream is edited to say (its partial text is not kept)."""

CUT_PART = "…"
"""What the later messages of a cut stream are edited to (a message cannot be empty)."""

RECOVERED_NOTE = "♻️ Completed after the gateway restarted."
"""The line added under a streamed reply finished by the recovery rather than by its turn."""


@dataclass
class Layout:
    """The messages a streamed reply is shown in: each message's platform id and the offset in
    the reply where its text starts (the last one shows the rest)."""

    messages: list[tuple[str, int]] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)
    """What each message shows now (in memory only: after a restart it is unknown)."""

    def to_metadata(self) -> dict[str, Any]:
        return {"messages": [[message_id, offset] for message_id, offset in self.messages]}

    def to_json(self) -> str:
        """The layout as a ledger row keeps it (``Obligation.stream_messages``)."""
        return json.dumps(self.to_metadata(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | None) -> Layout | None:
        """The layout a ledger row keeps; None when it keeps none (or it is damaged)."""
        try:
            return cls.from_metadata(json.loads(text)) if text else None
        except ValueError:
            return None

    @classmethod
    def from_metadata(cls, value: object) -> Layout | None:
        """The layout stored in a lane's metadata; None when there is none (or it is damaged)."""
        if not isinstance(value, dict) or not isinstance(value.get("messages"), list):
            return None
        messages: list[tuple[str, int]] = []
        for item in value["messages"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], int)):  # fmt: skip
                return None
            messages.append((item[0], item[1]))
        return cls(messages, [""] * len(messages))


Commit = Callable[[Layout], Awaitable[None]]
"""Stores a layout (in the lane's metadata while its turn runs, in its reply's ledger row once
that is recorded: a writer step); awaited before going on."""


def _cut(text: str, limit: int, measure: Callable[[str], int]) -> int:
    """Where to end a message holding the start of ``text``: the longest prefix within
    ``limit``, ended after a paragraph, a line, a sentence or a space when one is in its second
    half (else at the limit itself)."""
    low, high = 1, len(text)
    while low < high:  # the longest prefix within the limit (measure grows with the prefix)
        middle = (low + high + 1) // 2
        if measure(text[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    end = low
    for separator in ("\n\n", "\n", ". ", " "):
        found = text.rfind(separator, end // 2, end)
        if found > 0:
            return found + len(separator)
    return end


async def render(
    adapter: EditingAdapter,
    source: SessionSource,
    layout: Layout,
    text: str,
    commit: Commit,
    *,
    reply_to: str | None = None,
) -> SendResult:
    """Make ``layout``'s messages show ``text``: each message keeps the part up to where the
    next one starts, the last one shows the rest, and what does not fit there goes to new
    messages (each stored with ``commit`` before going on). Only what changed is edited; the
    first failure is the result."""
    limit, measure = adapter.message_limit, adapter.measure
    index = 0
    while True:
        if index == len(layout.messages):  # a new message for the rest (the first, or more)
            start = layout.messages[-1][1] + len(layout.shown[-1]) if layout.messages else 0
            rest = text[start:]
            if layout.messages and not rest.strip():
                return SendResult(ok=True)
            part = rest if measure(rest) <= limit else rest[: _cut(rest, limit, measure)]
            posted = await adapter.post(source, part, reply_to=None if index else reply_to)
            if not posted.result.ok:
                return posted.result
            if posted.message_id is None:
                return _no_id()
            layout.messages.append((posted.message_id, start))
            layout.shown.append(part)
            await commit(layout)
            crash_point("stream_posted")
        else:
            start = layout.messages[index][1]
            if index + 1 < len(layout.messages):  # its end is where the next one starts
                part = text[start : layout.messages[index + 1][1]]
            else:
                rest = text[start:]
                part = rest if measure(rest) <= limit else rest[: _cut(rest, limit, measure)]
            if layout.shown[index] != part:
                result = await adapter.edit(source, layout.messages[index][0], part)
                if not result.ok:
                    return result
                layout.shown[index] = part
                crash_point("stream_edited")
            if index + 1 == len(layout.messages) and start + len(part) >= len(text.rstrip()):
                return SendResult(ok=True)
        index += 1


def _no_id() -> SendResult:
    return SendResult(ok=False, failure_kind="rejected", error="the platform named no message id")


class Streamer:
    """Shows one turn's streamed reply as it grows: held back while it may still be silence,
    then posted, then edited at most once per ``interval`` seconds."""

    def __init__(
        self,
        adapter: EditingAdapter,
        source: SessionSource,
        reply_to: str | None,
        interval: float,
        commit: Commit,
        stopping: Callable[[], bool],
    ) -> None:
        self._adapter = adapter
        self._source = source
        self._reply_to = reply_to
        self._interval = interval
        self._commit = commit
        self._stopping = stopping
        self.layout: Layout | None = None
        """The messages posted so far (None until the first)."""
        self.text = ""
        """The reply written so far."""
        self._failed = False

    async def consume(self, chunks: AsyncIterator[str], waiting: Callable[[bool], None]) -> str:
        """Read the agent's chunks until the end (or a stop), showing the text as it grows;
        ``waiting(True)`` while the agent is being waited for (it may be cancelled then). The
        reply written, which the caller stores; the last edit is its delivery."""
        shown_at = 0.0
        iterator = chunks.__aiter__()
        while not self._stopping():
            waiting(True)
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                break
            finally:
                waiting(False)
            self.text += str(chunk)
            if self._failed or could_become_silent(self.text):
                continue
            if self.layout is None or time.monotonic() - shown_at >= self._interval:
                await self._show(clean_text(self.text))
                shown_at = time.monotonic()  # the next edit waits a whole interval after it
        await _close(iterator)
        return self.text

    async def _show(self, text: str) -> None:
        if self.layout is None:  # the turn's start recorded that a stream is under way
            self.layout = Layout()
            crash_point("stream_started")
        result = await render(
            self._adapter, self._source, self.layout, text, self._commit, reply_to=self._reply_to
        )  # fmt: skip
        if not result.ok:  # the finished reply is still recorded and sent by its delivery
            logger.warning("a streamed reply could not be shown: %s", result.error)
            self._failed = True


async def _close(iterator: AsyncIterator[str]) -> None:
    """Close an async generator the stream ended early (a stop), so its cleanup runs."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            logger.exception("the agent's stream failed while closing")
