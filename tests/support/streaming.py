"""An adapter that can edit what it posted (and show typing), and agents that stream, for the
streaming tests: in memory, or with every message kept in a JSON file that a killed process
leaves behind (``chats.json``: each message's id, chat, text and edits)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hermes_core import Agent, Posted, SendResult, SessionSource, TurnRequest


@dataclass
class Message:
    """One message in a chat: its text now and how often it was edited."""

    message_id: str
    chat_id: str
    text: str
    reply_to: str | None
    edits: int = 0


@dataclass
class EditingChats:
    """An ``EditingAdapter`` and ``TypingAdapter`` over chats kept in memory (and, given
    ``path``, written to that file after every change, before the change is reported)."""

    platform: str = "telegram"
    message_limit: int = 4096
    typing_interval_secs: float = 0.05
    path: Path | None = None
    messages: list[Message] = field(default_factory=list)
    typing_calls: int = 0
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.path is not None and self.path.exists():
            for item in json.loads(self.path.read_text()):
                self.messages.append(Message(**item))
            self._ids = itertools.count(len(self.messages) + 1)

    def measure(self, text: str) -> int:
        return len(text)

    def is_connected(self) -> bool:
        return True

    def _save(self) -> None:
        if self.path is not None:
            data = [vars(message) for message in self.messages]
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text(json.dumps(data))
            temporary.replace(self.path)

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        assert 0 < len(text) <= self.message_limit, text
        message = Message(f"m{next(self._ids)}", source.chat_id, text, reply_to)
        self.messages.append(message)
        self._save()
        return Posted(SendResult(ok=True), message.message_id)

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        assert 0 < len(text) <= self.message_limit, text
        message = next(m for m in self.messages if m.message_id == message_id)
        message.text, message.edits = text, message.edits + 1
        self._save()
        return SendResult(ok=True)

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        return (await self.post(source, text, reply_to=reply_to)).result

    async def typing(self, source: SessionSource) -> None:
        self.typing_calls += 1

    def texts(self, chat_id: str) -> list[str]:
        """The texts of the chat's messages now, in order."""
        return [m.text for m in self.messages if m.chat_id == chat_id]


class StreamingAgent(Agent):
    """Streams ``chunks`` (each after ``pause`` seconds); then, with ``hang``, waits forever."""

    def __init__(self, chunks: Sequence[str], pause: float = 0.0, hang: bool = False) -> None:
        self.chunks = list(chunks)
        self.pause = pause
        self.hang = hang
        self.hanging = asyncio.Event()
        """Set once every chunk was taken (the gateway has read them all) and it waits."""

    async def run_turn(self, request: TurnRequest) -> AsyncIterator[str]:
        for chunk in self.chunks:
            await asyncio.sleep(self.pause)
            yield chunk
        if self.hang:
            self.hanging.set()
            await asyncio.Event().wait()
