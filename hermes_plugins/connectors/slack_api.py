"""Slack's Web API for the Slack connector: ``chat.postMessage`` (and ``chat.update`` for a
streamed reply) as the gateway's adapter, and ``auth.test`` to check the bot token at start.

Slack answers most refusals with HTTP 200 and ``{"ok": false, "error": "<code>"}``; the codes
map to the ledger's failure kinds here. A reply is cut at :data:`MESSAGE_LIMIT` characters (as
sent, after escaping) and its mrkdwn control characters are escaped, so the agent's text shows
as written and cannot mention ``@channel`` or forge a link.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from hermes_core.domain.errors import ConfigError
from hermes_core.domain.models import SessionSource
from hermes_core.domain.splitting import split_reply
from hermes_core.gateway.agents import Posted
from hermes_core.turns.ledger import SendResult
from hermes_plugins.connectors.base import (
    PartSender,
    api_client,
    http_failure,
    retry_after,
    transport_failure,
)

__all__ = ["MESSAGE_LIMIT", "SlackAdapter", "escape_mrkdwn", "post_failure", "split_message"]

logger = logging.getLogger(__name__)

MESSAGE_LIMIT = 4000
"""Characters per message: Slack asks clients to keep a message's text to 4,000 characters (it
truncates past 40,000, and long messages cannot be edited), so longer replies go in parts."""

PERMANENT_ERRORS = frozenset(
    {"channel_not_found", "not_in_channel", "is_archived", "account_inactive", "invalid_auth",
     "token_revoked"}
)  # fmt: skip
"""``chat.postMessage`` errors that sending again cannot cure: the ledger abandons the reply."""

_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def escape_mrkdwn(text: str) -> str:
    """``text`` with the three characters Slack's formatting reserves (``&``, ``<``, ``>``)
    written as the entities Slack documents, so that it shows as written."""
    return "".join(_ESCAPES.get(char, char) for char in text)


def _sent_length(text: str) -> int:
    """The length of ``text`` once escaped: what Slack counts."""
    return len(text) + sum(len(_ESCAPES[char]) - 1 for char in text if char in _ESCAPES)


def split_message(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """``text`` cut into parts of at most ``limit`` characters each once escaped (cut before
    escaping, so an entity is never cut in two)."""
    return split_reply(text, limit, measure=_sent_length)


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a Web API answer ({} when the body is not one)."""
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def post_failure(response: httpx.Response) -> SendResult | None:
    """What a ``chat.postMessage`` (or ``chat.update``) answer means for the ledger; None when
    the message arrived."""
    wait = retry_after(response.headers.get("retry-after"))
    if response.status_code != 200:
        return http_failure(response.status_code, f"HTTP {response.status_code}", wait)
    answer = _answer(response)
    if answer.get("ok") is True:
        return None
    error = str(answer.get("error") or "no error code")
    if error == "ratelimited":
        return SendResult(ok=False, failure_kind="rate_limited", error=error, retry_after=wait)
    if error in PERMANENT_ERRORS:
        return SendResult(ok=False, failure_kind="permanent", error=error)
    return SendResult(ok=False, failure_kind="rejected", error=error)


class SlackAdapter:
    """Sends replies with ``chat.postMessage``: into the lane's thread (``thread_ts``) when it
    is one, else into the channel, in parts of :data:`MESSAGE_LIMIT` characters; edits a
    streamed reply's messages with ``chat.update``. Slack shows no typing indicator for a bot
    of the Events API, so this adapter has none."""

    platform = "slack"
    message_limit = MESSAGE_LIMIT

    def __init__(self, api_base: str, token: str) -> None:
        self._api_base = api_base.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._client: httpx.AsyncClient | None = None
        self._parts = PartSender(split_message)
        self.identity = ""
        """``@bot in team`` once ``auth.test`` answered."""

    def is_connected(self) -> bool:
        return self._client is not None

    async def connect(self, token_key: str, api_key: str, source: str | None) -> None:
        """Open the client and check the token with ``auth.test``; a ``ConfigError`` naming
        ``token_key`` when Slack refuses it, ``api_key`` when Slack cannot be reached."""
        client = api_client(self._api_base, self._headers)
        try:
            response = await client.post(f"{self._api_base}/auth.test")
            answer = _answer(response)
        except httpx.HTTPError as exc:
            await client.aclose()
            raise ConfigError(
                api_key, f"Slack's Web API at {self._api_base} could not be reached to check the "
                f"bot token ({type(exc).__name__}); check the network or {api_key}.",
                source=source,
            ) from None  # fmt: skip
        if answer.get("ok") is not True:
            await client.aclose()
            error = answer.get("error") or f"HTTP {response.status_code}"
            raise ConfigError(
                token_key, f"Slack refused the bot token ({error}); export the app's Bot User "
                f"OAuth Token (xoxb-...) in the variable that {token_key} names.",
                source=source,
            )  # fmt: skip
        self.identity = f"@{answer.get('user', '?')} in {answer.get('team', '?')}"
        self._client = client

    async def close(self) -> None:
        """Close the client: sends report ``disconnected`` from now on."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def measure(self, text: str) -> int:
        """The length of ``text`` once escaped, what Slack counts against the limit."""
        return _sent_length(text)

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        async def send_part(part: str, index: int) -> SendResult:
            return (await self.post(source, part)).result

        return await self._parts.send(source, text, send_part)

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        """One ``chat.postMessage`` of ``text`` (escaped, not split) into the lane's thread
        when it is one; the message's ``ts`` is its id. Slack replies in threads, not to
        messages: ``reply_to`` is not used."""
        body: dict[str, Any] = {"channel": source.chat_id, "text": escape_mrkdwn(text)}
        if source.thread_id:
            body["thread_ts"] = source.thread_id
        result, answer = await self._call("chat.postMessage", body)
        ts = answer.get("ts")
        return Posted(result, ts if result.ok and isinstance(ts, str) else None)

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        """``chat.update`` of the message whose ``ts`` is ``message_id`` to ``text``
        (escaped)."""
        body = {"channel": source.chat_id, "ts": message_id, "text": escape_mrkdwn(text)}
        return (await self._call("chat.update", body))[0]

    async def _call(self, method: str, body: dict[str, Any]) -> tuple[SendResult, dict[str, Any]]:
        """One Web API call sending a message's text: what it means for the ledger, and
        Slack's answer."""
        client = self._client
        if client is None:
            return SendResult(ok=False, failure_kind="disconnected", error="not connected"), {}
        try:
            response = await client.post(f"{self._api_base}/{method}", json=body)
        except httpx.HTTPError as exc:
            return transport_failure(exc), {}
        failure = post_failure(response)
        if failure is not None:
            logger.warning("slack refused %s to %s: %s", method, body["channel"], failure.error)
            return failure, {}
        return SendResult(ok=True), _answer(response)
