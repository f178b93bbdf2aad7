"""The Telegram Bot API over HTTP (``<api_base>/bot<token>/<method>``), and the adapter that
sends replies through it with ``sendMessage``, grows a streamed reply in place with
``editMessageText`` and shows ``typing`` with ``sendChatAction``.

A reply is split at Telegram's limit of 4,096 UTF-16 code units per message (on paragraph, line
and sentence boundaries, code blocks kept whole where they fit); only the first part replies to
the triggering message. What the Bot API answers becomes the ledger's failure kind: 429 is
``rate_limited`` after its ``retry_after``, 403 (the bot blocked or removed) and "chat not found"
are ``permanent``, another 400 is ``rejected``, no answer is ``disconnected``. A part refused
because its ``parse_mode`` entities cannot be parsed is sent again as plain text, and one
refused because the group became a supergroup (``migrate_to_chat_id``) is sent there. Edits
follow the same rules, and one refused as "message is not modified" succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from hermes_core.domain.models import SessionSource
from hermes_core.domain.splitting import split_reply, utf16_len
from hermes_core.gateway.agents import Posted
from hermes_core.turns.ledger import SendResult
from hermes_plugins.connectors.base import (
    API_TIMEOUT,
    PartSender,
    api_client,
    http_failure,
    retry_after,
    transport_failure,
)

__all__ = ["MESSAGE_LIMIT", "BotApi", "BotApiError", "TelegramAdapter"]

MESSAGE_LIMIT = 4096
"""The most UTF-16 code units ``sendMessage`` takes in one text."""
GENERAL_TOPIC = "1"
"""The thread id of a forum's General topic, which ``sendMessage`` refuses as
``message_thread_id`` ("message thread not found"): a message without one goes there."""
MESSAGE_ID_BOUND = 1 << 31
"""Message ids fit in 32 bits; a button press's event carries its callback query's id, a
64-bit number, which is no message to reply to."""
_ENTITIES_REFUSED = "can't parse entities"
"""What a 400 answer's description says when the text is not valid in its ``parse_mode``."""
_NOT_MODIFIED = "message is not modified"
"""What a 400 answer to ``editMessageText`` says when the message shows that text already: the
edit's goal is met (a recovery edits messages again with the text they may already show)."""
TYPING_INTERVAL_SECS = 4.0
"""How often ``typing`` is sent again while a turn runs: Telegram shows it for about 5 s."""

logger = logging.getLogger(__name__)


class BotApiError(Exception):
    """The Bot API refused a call: its HTTP status, ``description`` and ``parameters``."""

    def __init__(self, status: int, description: str, parameters: Mapping[str, Any]) -> None:
        super().__init__(f"{status} {description}")
        self.status = status
        self.description = description
        self.parameters = parameters


class _RedactToken(logging.Filter):
    """Hides the bot token in what ``httpx`` logs (request lines carry it in the URL path)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.token in message:
            record.msg, record.args = message.replace(self.token, "<token>"), ()
        return True


class BotApi:
    """Calls Bot API methods through one :func:`~hermes_plugins.connectors.base.api_client`,
    opened on first use (again after ``close``: a drain's replies leave after the poller
    stopped); the token, part of every URL, is never logged."""

    def __init__(self, api_base: str, token: str) -> None:
        self.api_base = api_base.rstrip("/")
        self._base = f"{self.api_base}/bot{token}/"
        self._redact = _RedactToken(token)
        self._client: httpx.AsyncClient | None = None

    async def call(
        self, method: str, params: Mapping[str, Any], *, read_timeout: float | None = None
    ) -> Any:
        """The ``result`` of ``method``; ``BotApiError`` when refused, ``httpx.HTTPError``
        when no answer came. ``read_timeout`` replaces the usual one (a long poll's)."""
        timeout = API_TIMEOUT
        if read_timeout is not None:
            timeout = httpx.Timeout(
                API_TIMEOUT.write, connect=API_TIMEOUT.connect, read=read_timeout
            )
        if self._client is None:
            logging.getLogger("httpx").addFilter(self._redact)
            self._client = api_client(self._base)
        response = await self._client.post(method, json=dict(params), timeout=timeout)
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise BotApiError(response.status_code, f"HTTP {response.status_code}", {})
        if answer.get("ok") is True:
            return answer.get("result")
        parameters = answer.get("parameters")
        raise BotApiError(
            int(answer.get("error_code") or response.status_code),
            str(answer.get("description") or f"HTTP {response.status_code}"),
            parameters if isinstance(parameters, dict) else {},
        )

    async def close(self) -> None:
        """Close the connections."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
            logging.getLogger("httpx").removeFilter(self._redact)


def _split(text: str) -> list[str]:
    return split_reply(text, MESSAGE_LIMIT, measure=utf16_len)


def _place(source: SessionSource) -> dict[str, Any]:
    """The chat of ``source`` and its forum topic (the General topic is named by none)."""
    place: dict[str, Any] = {"chat_id": source.chat_id}
    if source.thread_id and source.thread_id != GENERAL_TOPIC:
        place["message_thread_id"] = source.thread_id
    return place


@dataclass
class TelegramAdapter:
    """Sends replies with ``sendMessage``, in ``parse_mode`` (None: plain text); edits a
    streamed reply's messages with ``editMessageText`` and shows ``typing`` while a turn runs."""

    api: BotApi
    parse_mode: str | None = None
    platform: str = "telegram"
    connected: bool = False
    """Set by the connector once the token was accepted, cleared when it stops."""
    message_limit: int = MESSAGE_LIMIT
    typing_interval_secs: float = TYPING_INTERVAL_SECS
    _parts: PartSender = field(default_factory=lambda: PartSender(_split))

    def is_connected(self) -> bool:
        return self.connected

    def measure(self, text: str) -> int:
        """Telegram counts a message's length in UTF-16 code units."""
        return utf16_len(text)

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` into the chat and forum topic of ``source`` in parts, the first part
        replying to ``reply_to`` when it is a message id (a button press's is not)."""

        async def send_part(part: str, index: int) -> SendResult:
            return (await self.post(source, part, reply_to=None if index else reply_to)).result

        return await self._parts.send(source, text, send_part)

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        """One ``sendMessage`` of ``text`` (not split), replying to ``reply_to`` when it is a
        message id; the message's id from Telegram's answer."""
        params = {**_place(source), "text": text}
        if reply_to and reply_to.isdecimal() and int(reply_to) < MESSAGE_ID_BOUND:
            params["reply_parameters"] = {
                "message_id": int(reply_to), "allow_sending_without_reply": True
            }  # fmt: skip
        return await self._with_parse_mode("sendMessage", params)

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        """``editMessageText`` of a message this adapter posted; an edit to the text the
        message already shows ("message is not modified") succeeds."""
        if not message_id.isdecimal():
            error = f"{message_id!r} is not a Telegram message id"
            return SendResult(ok=False, failure_kind="rejected", error=error)
        params = {"chat_id": source.chat_id, "message_id": int(message_id), "text": text}
        return (await self._with_parse_mode("editMessageText", params)).result

    async def typing(self, source: SessionSource) -> None:
        """``sendChatAction`` ``typing`` in the chat and topic of ``source``; a refusal or no
        answer is logged, never raised."""
        try:
            await self.api.call("sendChatAction", {**_place(source), "action": "typing"})
        except httpx.HTTPError as exc:
            logger.info("Telegram's typing indicator failed: %s", transport_failure(exc).error)
        except BotApiError as exc:
            failure = _failure(exc)
            logger.info("Telegram refused the typing indicator (%s): %s",
                        failure.failure_kind, failure.error)  # fmt: skip

    async def _with_parse_mode(self, method: str, params: dict[str, Any]) -> Posted:
        """One call sending a text; in plain text again when the entities cannot be parsed."""
        if self.parse_mode:
            posted = await self._attempt(method, {**params, "parse_mode": self.parse_mode})
            if posted.result.ok or _ENTITIES_REFUSED not in (posted.result.error or "").lower():
                return posted
            logger.info("Telegram could not parse a reply as %s; sent as plain text",
                        self.parse_mode)  # fmt: skip
        return await self._attempt(method, params)

    async def _attempt(self, method: str, params: dict[str, Any]) -> Posted:
        try:
            answer = await self.api.call(method, params)
        except httpx.HTTPError as exc:
            return Posted(transport_failure(exc))
        except BotApiError as exc:
            moved = exc.parameters.get("migrate_to_chat_id")
            if moved is not None and str(moved) != str(params["chat_id"]):
                logger.info("chat %s became supergroup %s; the reply goes there",
                            params["chat_id"], moved)  # fmt: skip
                return await self._attempt(method, {**params, "chat_id": moved})
            if exc.status == 400 and _NOT_MODIFIED in exc.description.lower():
                return Posted(SendResult(ok=True), str(params.get("message_id")))
            return Posted(_failure(exc))
        message_id = answer.get("message_id") if isinstance(answer, dict) else None
        return Posted(SendResult(ok=True), None if message_id is None else str(message_id))


def _failure(exc: BotApiError) -> SendResult:
    """A refused call as the ledger's failure kind."""
    if exc.status == 400 and "chat not found" in exc.description.lower():
        return SendResult(ok=False, failure_kind="permanent", error=exc.description)
    wait = retry_after(exc.parameters.get("retry_after")) if exc.status == 429 else None
    return http_failure(exc.status, exc.description, wait)
