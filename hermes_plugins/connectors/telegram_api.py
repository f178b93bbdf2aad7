"""The Telegram Bot API over HTTP (``<api_base>/bot<token>/<method>``), and the adapter that
sends replies through it with ``sendMessage``.

A reply is split at Telegram's limit of 4,096 UTF-16 code units per message (on paragraph, line
and sentence boundaries, code blocks kept whole where they fit); only the first part replies to
the triggering message. What the Bot API answers becomes the ledger's failure kind: 429 is
``rate_limited`` after its ``retry_after``, 403 (the bot blocked or removed) and "chat not found"
are ``permanent``, another 400 is ``rejected``, no answer is ``disconnected``. A part refused
because its ``parse_mode`` entities cannot be parsed is sent again as plain text, and one
refused because the group became a supergroup (``migrate_to_chat_id``) is sent there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from hermes_core.domain.models import SessionSource
from hermes_core.domain.splitting import split_reply, utf16_len
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


@dataclass
class TelegramAdapter:
    """Sends replies with ``sendMessage``, in ``parse_mode`` (None: plain text)."""

    api: BotApi
    parse_mode: str | None = None
    platform: str = "telegram"
    connected: bool = False
    """Set by the connector once the token was accepted, cleared when it stops."""
    _parts: PartSender = field(default_factory=lambda: PartSender(_split))

    def is_connected(self) -> bool:
        return self.connected

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` into the chat and forum topic of ``source``, the first part replying
        to ``reply_to`` when it is a message id (a button press's is not)."""
        base: dict[str, Any] = {"chat_id": source.chat_id}
        if source.thread_id and source.thread_id != GENERAL_TOPIC:
            base["message_thread_id"] = source.thread_id
        reply = None
        if reply_to and reply_to.isdecimal() and int(reply_to) < MESSAGE_ID_BOUND:
            reply = {"message_id": int(reply_to), "allow_sending_without_reply": True}

        async def send_part(part: str, index: int) -> SendResult:
            params = {**base, "text": part}
            if reply is not None and index == 0:
                params["reply_parameters"] = reply
            return await self._send_message(params)

        return await self._parts.send(source, text, send_part)

    async def _send_message(self, params: dict[str, Any]) -> SendResult:
        """One ``sendMessage``; in plain text again when the entities cannot be parsed."""
        if self.parse_mode:
            result = await self._attempt({**params, "parse_mode": self.parse_mode})
            if result.ok or _ENTITIES_REFUSED not in (result.error or "").lower():
                return result
            logger.info("Telegram could not parse a reply as %s; sent as plain text",
                        self.parse_mode)  # fmt: skip
        return await self._attempt(params)

    async def _attempt(self, params: dict[str, Any]) -> SendResult:
        try:
            await self.api.call("sendMessage", params)
        except httpx.HTTPError as exc:
            return transport_failure(exc)
        except BotApiError as exc:
            moved = exc.parameters.get("migrate_to_chat_id")
            if moved is not None and str(moved) != str(params["chat_id"]):
                logger.info("chat %s became supergroup %s; the reply goes there",
                            params["chat_id"], moved)  # fmt: skip
                return await self._attempt({**params, "chat_id": moved})
            return _failure(exc)
        return SendResult(ok=True)


def _failure(exc: BotApiError) -> SendResult:
    """A refused ``sendMessage`` as the ledger's failure kind."""
    if exc.status == 400 and "chat not found" in exc.description.lower():
        return SendResult(ok=False, failure_kind="permanent", error=exc.description)
    wait = retry_after(exc.parameters.get("retry_after")) if exc.status == 429 else None
    return http_failure(exc.status, exc.description, wait)
