"""What a host gives the runtime: the ``Agent`` and ``Adapter`` protocols and the optional
``HostCallbacks``, with the ``EchoAgent`` and the in-memory and console adapters that ship for
demos, tests and the console commands."""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.domain.terminal import safe_text
from hermes_core.turns.ledger import SendResult


@dataclass
class HostCallbacks:
    """The host's single-answer callbacks; each is optional."""

    interrupt_background: Callable[[str, str], object] | None = None
    """Stop the lane's background work (key, current session id); idempotent."""
    wake_allowed: Callable[[MessageEvent, str], bool] | None = None
    """May an internal wake bound to an older session run in the current one (event, id)?"""
    authorised: Callable[[SessionSource], bool] | None = None
    """Authorisation re-check of a resumed lane's sender."""
    diagnostic_muted: Callable[[str, str], bool] | None = None
    """Does the chat policy mute this diagnostic reply (key, text)?"""
    has_active_processes: Callable[[str], bool] | None = None
    """Does the lane have live background processes (never pruned)?"""


@dataclass(frozen=True)
class TurnRequest:
    """One turn for an agent: the lane, the session-context prompt and the new message
    (sender-prefixed in shared sessions, after a resume note when resuming).

    The stored history is loaded on demand (``await request.history()``): an agent kept in the
    cache holds its conversation in memory and needs the store only after it was (re)built.
    """

    session_key: str
    session_id: str
    system_prompt: str
    message: str
    event: MessageEvent
    load_history: Callable[[], list[dict[str, Any]]]
    """Blocking read of the transcript before this turn's message."""

    async def history(self) -> list[dict[str, Any]]:
        """The stored transcript before this turn's message (read in a worker thread)."""
        return await asyncio.to_thread(self.load_history)


@runtime_checkable
class Agent(Protocol):
    """The embedder's agent for one session (cached per session key).

    Any object with these four methods is an agent. Subclassing ``Agent`` gives the defaults
    of the last three, so only ``run_turn`` is left to write: the turn cannot be interrupted,
    and releasing or cleaning up does nothing.
    """

    @abstractmethod
    def run_turn(self, request: TurnRequest) -> Awaitable[str | None] | AsyncIterator[str]:
        """Run one turn: as a coroutine (``async def``) giving the final reply, or None when
        nothing is owed; or as an async iterator of the reply's chunks (``async def`` with
        ``yield``), shown as it grows where the platform can edit a sent message."""

    async def interrupt(self) -> bool:
        """Ask the running turn to stop early; False when it cannot be interrupted safely."""
        return False

    def soft_release(self) -> None:
        """Drop what is held in memory (eviction); the next turn rebuilds from the store."""
        return  # a body, so that type checkers do not take the default for abstract

    def cleanup(self) -> None:
        """Shut down for good (a session boundary or the gateway's stop)."""
        return


@runtime_checkable
class Adapter(Protocol):
    """A platform connection: sends replies and says whether it is connected."""

    platform: str

    def is_connected(self) -> bool:
        """Whether sends can be attempted now."""
        ...

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` to the chat of ``source`` (in its thread); report success or why not."""
        ...


@dataclass(frozen=True)
class Posted:
    """What posting one message reported: the send's result and, once the platform accepted
    it, the platform's id of the message (what :meth:`EditingAdapter.edit` edits)."""

    result: SendResult
    message_id: str | None = None


@runtime_checkable
class EditingAdapter(Protocol):
    """An adapter that can edit a message it sent, so that a streamed reply grows in place
    (Telegram ``editMessageText``, Slack ``chat.update``, Discord message edits). A streamed
    reply is one message while it fits ``message_limit`` (in the platform's own measure,
    ``measure``), then continues in a new one."""

    message_limit: int

    def measure(self, text: str) -> int:
        """The length of ``text`` as the platform counts it against ``message_limit``."""
        ...

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        """Send ``text`` (at most ``message_limit``) as one message, not split."""
        ...

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        """Replace the text of the message ``message_id`` this adapter posted."""
        ...


@runtime_checkable
class TypingAdapter(Protocol):
    """An adapter that can show the chat that the bot is typing (Telegram ``sendChatAction``,
    Discord's typing endpoint); the gateway calls it while a turn runs, again before the
    platform's indicator expires (``typing_interval_secs``)."""

    typing_interval_secs: float

    async def typing(self, source: SessionSource) -> None:
        """Show the indicator in the chat (and thread) of ``source``; failures are the
        adapter's to log, never raised."""
        ...


class EchoAgent:
    """Answers ``echo: <message>``; a resumed turn answers the last human message it finds.

    ``delay`` seconds of (interruptible) thinking let tests keep a turn running.
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.turns = 0
        self.released = 0
        self.cleaned = False
        self._interrupted = asyncio.Event()

    async def run_turn(self, request: TurnRequest) -> str | None:
        self.turns += 1
        self._interrupted.clear()
        if self.delay:
            try:
                await asyncio.wait_for(self._interrupted.wait(), self.delay)
                return None  # interrupted: nothing to say
            except asyncio.TimeoutError:
                pass
        if request.event.internal and not request.event.text:
            for message in reversed(await request.history()):
                if message.get("role") == "user" and message.get("display_kind") is None:
                    return f"echo: {message.get('content')}"
        return f"echo: {request.message}"

    async def interrupt(self) -> bool:
        self._interrupted.set()
        return True

    def soft_release(self) -> None:
        self.released += 1

    def cleanup(self) -> None:
        self.cleaned = True


@dataclass
class SentMessage:
    """What an :class:`InMemoryAdapter` delivered."""

    chat_id: str
    thread_id: str | None
    text: str
    reply_to: str | None


@dataclass
class InMemoryAdapter:
    """An adapter that keeps what it sends; ``connected`` and ``fail_with`` steer it in tests."""

    platform: str
    connected: bool = True
    fail_with: SendResult | None = None
    sent: list[SentMessage] = field(default_factory=list)

    def is_connected(self) -> bool:
        return self.connected

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        if not self.connected:
            return SendResult(ok=False, failure_kind="disconnected", error="not connected")
        if self.fail_with is not None:
            return self.fail_with
        self.sent.append(SentMessage(source.chat_id, source.thread_id, text, reply_to))
        return SendResult(ok=True)

    def texts(self, chat_id: str | None = None) -> list[str]:
        """The texts sent (to one chat)."""
        return [m.text for m in self.sent if chat_id is None or m.chat_id == chat_id]


@dataclass
class ConsoleAdapter:
    """An adapter that prints what the gateway sends (``→ platform:chat[/thread]: text``) on
    standard output, after ``indent``; control characters and bidi overrides as escapes
    (:func:`~hermes_core.domain.terminal.safe_text`, a reply's lines kept)."""

    platform: str
    indent: str = "  "

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        thread = f"/{source.thread_id}" if source.thread_id else ""
        line = f"{self.indent}→ {source.platform}:{source.chat_id}{thread}: {text}"
        print(safe_text(line, keep_lines=True), flush=True)
        return SendResult(ok=True)
