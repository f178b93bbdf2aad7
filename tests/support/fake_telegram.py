"""A fake Telegram Bot API (a Starlette app; serve it with ``LoopbackServer``) for the connector
tests: ``getMe``, ``getWebhookInfo``, ``setWebhook``, ``getUpdates`` with real long polling and
Telegram's offset rule, ``answerCallbackQuery``, ``sendMessage``, which records what it received
and can be told to refuse (429 with ``retry_after``, 403, entities it cannot parse, a group chat
that became a supergroup), ``editMessageText``, which replaces a sent message's text (and
answers "message is not modified" for the text it has), and ``sendChatAction``, recorded."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hermes_core.domain.splitting import utf16_len

TOKEN = "123456:TEST-token_for-the-fake"
BOT_USERNAME = "hermes_test_bot"
POLL_STEP_SECS = 0.02


@dataclass(frozen=True)
class Sent:
    """One ``sendMessage`` the fake accepted."""

    chat_id: str
    thread_id: str | None
    reply_to: int | None
    text: str
    parse_mode: str | None
    message_id: int = 0


@dataclass
class FakeTelegram:
    """The fake's state, shared between the test and the server's thread."""

    token: str = TOKEN
    pending: list[dict[str, Any]] = field(default_factory=list)
    """Updates not yet confirmed (an offset above their id confirms them)."""
    sent: list[Sent] = field(default_factory=list)
    offsets: list[int | None] = field(default_factory=list)
    """The ``offset`` of every ``getUpdates``, in order."""
    allowed_updates: list[str] | None = None
    webhook: dict[str, Any] = field(default_factory=dict)
    """What ``setWebhook`` was given (``url``, ``secret_token``, ...)."""
    refused: deque[tuple[int, str, dict[str, Any]]] = field(default_factory=deque)
    """Answers of the next ``sendMessage`` and ``editMessageText`` calls: (status,
    description, parameters)."""
    refuse_entities: bool = False
    """Whether a ``sendMessage`` with a ``parse_mode`` is refused as unparsable."""
    migrated: dict[str, int] = field(default_factory=dict)
    """Group chats upgraded to supergroups: their old id, the new one."""
    answered_queries: list[str] = field(default_factory=list)
    """The ``callback_query_id`` of every ``answerCallbackQuery``."""
    attempts: int = 0
    """Every ``sendMessage`` received, refused ones included."""
    texts_now: dict[int, str] = field(default_factory=dict)
    """Each sent message's text now (after its edits), by message id."""
    edits: list[tuple[int, str]] = field(default_factory=list)
    """Every ``editMessageText`` that changed a message: (message id, its new text)."""
    unchanged_edits: int = 0
    """``editMessageText`` calls refused as "message is not modified"."""
    actions: list[tuple[str, str | None, str]] = field(default_factory=list)
    """Every ``sendChatAction``: (chat id, message thread id, action)."""
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(100))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def queue(self, update: dict[str, Any]) -> int:
        """Queue ``update`` for the pollers, under a new ``update_id`` (returned)."""
        with self._lock:
            update_id = next(self._ids)
            self.pending.append({"update_id": update_id, **update})
        return update_id

    def refuse_next(self, status: int, description: str, **parameters: Any) -> None:
        """Answer the next ``sendMessage`` or ``editMessageText`` with this error (once)."""
        self.refused.append((status, description, parameters))

    def texts(self) -> list[str]:
        return [message.text for message in self.sent]

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/bot{token}/{method}", self._handle, methods=["POST"])])

    async def _handle(self, request: Request) -> JSONResponse:
        if request.path_params["token"] != self.token:
            return _error(401, "Unauthorized")
        params = await request.json() if await request.body() else {}
        method = request.path_params["method"]
        if method == "getMe":
            return _ok({"id": 123456, "is_bot": True, "username": BOT_USERNAME})
        if method == "getWebhookInfo":
            return _ok({"url": self.webhook.get("url", ""), "pending_update_count": 0})
        if method == "setWebhook":
            self.webhook = dict(params)
            return _ok(True)
        if method == "getUpdates":
            return await self._get_updates(params)
        if method == "answerCallbackQuery":
            self.answered_queries.append(str(params.get("callback_query_id")))
            return _ok(True)
        if method == "sendMessage":
            return self._send_message(params)
        if method == "editMessageText":
            return self._edit_message_text(params)
        if method == "sendChatAction":
            thread = params.get("message_thread_id")
            action = (str(params.get("chat_id")), None if thread is None else str(thread),
                      str(params.get("action")))  # fmt: skip
            self.actions.append(action)
            return _ok(True)
        return _error(404, "Not Found: method not found")

    async def _get_updates(self, params: dict[str, Any]) -> JSONResponse:
        if self.webhook.get("url"):
            return _error(409, "Conflict: can't use getUpdates method while webhook is active")
        offset = params.get("offset")
        with self._lock:
            self.offsets.append(offset)
            self.allowed_updates = params.get("allowed_updates", self.allowed_updates)
            if offset is not None:  # what lies below the offset is confirmed and forgotten
                self.pending = [u for u in self.pending if u["update_id"] >= offset]
        deadline = time.monotonic() + float(params.get("timeout", 0))
        while True:
            with self._lock:
                batch = self.pending[: int(params.get("limit", 100))]
            if batch or time.monotonic() >= deadline:
                return _ok(batch)
            await asyncio.sleep(POLL_STEP_SECS)

    def _send_message(self, params: dict[str, Any]) -> JSONResponse:
        with self._lock:
            self.attempts += 1
            if self.refused:
                status, description, parameters = self.refused.popleft()
                return _error(status, description, parameters)
        text = str(params.get("text", ""))
        moved = self.migrated.get(str(params.get("chat_id")))
        if moved is not None:
            description = "Bad Request: group chat was upgraded to a supergroup chat"
            return _error(400, description, {"migrate_to_chat_id": moved})
        if self.refuse_entities and params.get("parse_mode"):
            return _error(400, "Bad Request: can't parse entities: Can't find end of the entity")
        if str(params.get("message_thread_id")) == "1":
            return _error(400, "Bad Request: message thread not found")
        if not text or utf16_len(text) > 4096:
            return _error(400, "Bad Request: message is too long")
        thread = params.get("message_thread_id")
        reply = params.get("reply_parameters") or {}
        with self._lock:
            message_id = next(self._ids)
            self.sent.append(Sent(
                chat_id=str(params.get("chat_id")),
                thread_id=str(thread) if thread is not None else None,
                reply_to=reply.get("message_id"),
                text=text,
                parse_mode=params.get("parse_mode"),
                message_id=message_id,
            ))  # fmt: skip
            self.texts_now[message_id] = text
        return _ok({"message_id": message_id, "chat": {"id": params.get("chat_id")}, "text": text})

    def _edit_message_text(self, params: dict[str, Any]) -> JSONResponse:
        with self._lock:
            if self.refused:
                status, description, parameters = self.refused.popleft()
                return _error(status, description, parameters)
        text = str(params.get("text", ""))
        message_id = params.get("message_id")
        if not isinstance(message_id, int) or message_id not in self.texts_now:
            return _error(400, "Bad Request: message to edit not found")
        if self.refuse_entities and params.get("parse_mode"):
            return _error(400, "Bad Request: can't parse entities: Can't find end of the entity")
        if not text or utf16_len(text) > 4096:
            return _error(400, "Bad Request: MESSAGE_TOO_LONG")
        with self._lock:
            if self.texts_now[message_id] == text:
                self.unchanged_edits += 1
                return _error(400, "Bad Request: message is not modified: specified new message "
                              "content and reply markup are exactly the same")  # fmt: skip
            self.texts_now[message_id] = text
            self.edits.append((message_id, text))
        return _ok({"message_id": message_id, "chat": {"id": params.get("chat_id")}, "text": text})


def message_update(
    chat_id: int, text: str, *, message_id: int, thread_id: int | None = None, user_id: int = 42
) -> dict[str, Any]:
    """A ``message`` update from a user: in a private chat, or in a forum topic of a
    supergroup when ``thread_id`` is given."""
    if thread_id is None:
        chat: dict[str, Any] = {"id": chat_id, "type": "private", "first_name": "Ana"}
        topic: dict[str, Any] = {}
    else:
        chat = {"id": chat_id, "type": "supergroup", "title": "Forum", "is_forum": True}
        topic = {"message_thread_id": thread_id, "is_topic_message": True}
    return {
        "message": {
            "message_id": message_id, "date": 1_700_000_000, "chat": chat, "text": text,
            "from": {"id": user_id, "is_bot": False, "first_name": "Ana"}, **topic,
        }
    }  # fmt: skip


def _ok(result: Any) -> JSONResponse:
    return JSONResponse({"ok": True, "result": result})


def _error(status: int, description: str, parameters: dict[str, Any] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return JSONResponse(body, status_code=status)
