"""Discord's REST API (``<api_base>/...`` with ``Authorization: Bot <token>``) within its rate
limits, and the adapter that sends, edits and types through it.

Rate limits as Discord documents them: every answer names its bucket (``X-RateLimit-Bucket``)
with what is left of it (``X-RateLimit-Remaining``) and when it refills
(``X-RateLimit-Reset-After``, seconds); a route whose bucket is empty waits for the refill before
its next call. A 429 carries ``retry_after`` (seconds, in the JSON body) and says whether the
limit is global (``X-RateLimit-Global``, or ``global`` in the body); a global one holds every
call. A wait of at most :data:`INLINE_WAIT_SECS` is waited here; a longer one is the send's
``rate_limited`` result with its ``retry_after``, for the ledger to try again then.

A reply is split at Discord's 2,000 characters; the first part replies to the triggering message
(``message_reference``, which does not fail when that message is gone) and no part pings anyone
(``allowed_mentions`` parses nothing: an agent's text never mentions @everyone).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

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

__all__ = [
    "INLINE_WAIT_SECS", "MESSAGE_LIMIT", "DiscordAdapter", "DiscordRest", "RateLimitedError",
]  # fmt: skip

logger = logging.getLogger(__name__)

MESSAGE_LIMIT = 2000
"""The most characters Discord takes in one message's ``content``."""
INLINE_WAIT_SECS = 5.0
"""The longest rate-limit wait a call waits itself; a longer one is handed back to the caller."""
TYPING_INTERVAL_SECS = 8.0
"""Discord's typing indicator lasts about ten seconds."""
NO_MENTIONS: dict[str, Any] = {"parse": []}
_IDS = re.compile(r"/\d{5,}")
"""Snowflake ids in a route's path."""
_MAJOR = re.compile(r"^/(channels|guilds|webhooks)/(\d+)")
"""Buckets are per route and per major parameter (the channel, guild or webhook)."""


class RateLimitedError(Exception):
    """A call would have to wait longer than :data:`INLINE_WAIT_SECS`: ``wait`` seconds."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"rate limited for {wait:.1f} s")
        self.wait = wait


def _route(method: str, path: str) -> tuple[str, str]:
    """(the route with its ids blanked, the major parameter) of a call."""
    major = _MAJOR.match(path)
    return f"{method} {_IDS.sub('/{id}', path)}", major.group(2) if major else ""


@dataclass
class _Bucket:
    remaining: int
    reset_at: float


class DiscordRest:
    """Calls Discord's REST API through one :func:`~hermes_plugins.connectors.base.api_client`
    (opened on first use, again after ``close``: a drain's replies leave after the gateway
    stopped), waiting out the rate limits Discord reports."""

    def __init__(self, api_base: str, token: str) -> None:
        self.api_base = api_base.rstrip("/")
        self._headers = {"Authorization": f"Bot {token}"}
        self._client: httpx.AsyncClient | None = None
        self._bucket_of: dict[str, str] = {}
        """Route (ids blanked) → the bucket Discord named for it."""
        self._buckets: dict[str, _Bucket] = {}
        """:meth:`_key` → what is left of the bucket."""
        self._global_until = 0.0

    async def call(
        self, method: str, path: str, *, json: Any = None, params: Mapping[str, Any] | None = None
    ) -> httpx.Response:
        """Discord's answer to one call (any status but a 429 waited out here);
        ``RateLimitedError`` for a longer wait, ``httpx.HTTPError`` when no answer came."""
        route, major = _route(method, path)
        while True:
            await self._wait(route, major)
            if self._client is None:
                self._client = api_client(self.api_base, self._headers)
            response = await self._client.request(method, path, json=json, params=params)
            self._note(route, major, response)
            if response.status_code != 429:
                return response
            wait = self._limited(route, major, response)
            if wait > INLINE_WAIT_SECS:
                raise RateLimitedError(wait)
            logger.info("discord: %s rate limited, waiting %.2f s", route, wait)

    async def _wait(self, route: str, major: str) -> None:
        """Wait for the global limit and the route's bucket, or raise when that is too long."""
        now = time.monotonic()
        bucket = self._buckets.get(self._key(route, major))
        until = self._global_until
        if bucket is not None and bucket.remaining <= 0:
            until = max(until, bucket.reset_at)
        if until > now:
            if until - now > INLINE_WAIT_SECS:
                raise RateLimitedError(until - now)
            await asyncio.sleep(until - now)
        if bucket is not None:
            if bucket.reset_at <= time.monotonic() and bucket.remaining <= 0:
                bucket.remaining = 1  # refilled; the answer says by how much
            bucket.remaining -= 1  # taken now, so that concurrent calls queue behind it

    def _note(self, route: str, major: str, response: httpx.Response) -> None:
        """Remember the bucket state the answer reports."""
        name = response.headers.get("x-ratelimit-bucket")
        remaining = response.headers.get("x-ratelimit-remaining")
        reset = retry_after(response.headers.get("x-ratelimit-reset-after"))
        if name is None or remaining is None or reset is None:
            return
        try:
            left = int(remaining)
        except ValueError:
            return
        self._bucket_of[route] = name
        self._buckets[self._key(route, major)] = _Bucket(left, time.monotonic() + reset)

    def _key(self, route: str, major: str) -> str:
        """A bucket's key: the bucket Discord named for the route (the route itself until it
        named one) and the major parameter."""
        return f"{self._bucket_of.get(route, route)}:{major}"

    def _limited(self, route: str, major: str, response: httpx.Response) -> float:
        """The wait a 429 asks for; a global one holds every call until then."""
        try:
            body = response.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        wait = retry_after(body.get("retry_after"))
        if wait is None:
            wait = retry_after(response.headers.get("retry-after")) or 1.0
        until = time.monotonic() + wait
        if body.get("global") or response.headers.get("x-ratelimit-global", "").lower() == "true":
            self._global_until = max(self._global_until, until)
        else:
            self._buckets[self._key(route, major)] = _Bucket(0, until)
        return wait

    async def close(self) -> None:
        """Close the connections."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _split(text: str) -> list[str]:
    return split_reply(text, MESSAGE_LIMIT)


def _refused(response: httpx.Response) -> SendResult:
    """A refused call as the ledger's failure kind, with Discord's error message."""
    try:
        body = response.json()
    except ValueError:
        body = None
    said = body.get("message") if isinstance(body, dict) else None
    return http_failure(response.status_code, f"{response.status_code} {said or 'refused'}")


def _channel(source: SessionSource) -> str:
    """Where a reply goes: the thread (a channel of its own on Discord), else the channel."""
    return source.thread_id or source.chat_id


@dataclass
class DiscordAdapter:
    """Sends replies (``POST /channels/{id}/messages``), edits them and shows typing."""

    rest: DiscordRest
    platform: str = "discord"
    connected: bool = False
    """Set by the connector when it starts; it stays set after ``stop`` (REST needs no
    gateway session: a drain's replies still leave)."""
    message_limit: int = MESSAGE_LIMIT
    typing_interval_secs: float = TYPING_INTERVAL_SECS
    _parts: PartSender = field(default_factory=lambda: PartSender(_split))

    def is_connected(self) -> bool:
        return self.connected

    def measure(self, text: str) -> int:
        """Discord counts characters."""
        return len(text)

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` into the channel or thread of ``source`` in parts of at most 2,000
        characters, the first replying to ``reply_to``."""

        async def send_part(part: str, index: int) -> SendResult:
            posted = await self.post(source, part, reply_to=reply_to if index == 0 else None)
            return posted.result

        return await self._parts.send(source, text, send_part)

    async def post(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> Posted:
        """Send ``text`` (at most 2,000 characters) as one message; its id once accepted."""
        body: dict[str, Any] = {"content": text, "allowed_mentions": NO_MENTIONS}
        if reply_to and reply_to.isdecimal():
            body["message_reference"] = {"message_id": reply_to, "fail_if_not_exists": False}
        response, result = await self._call("POST", f"/channels/{_channel(source)}/messages", body)
        if response is None or not result.ok:
            return Posted(result)
        message = response.json()
        return Posted(result, str(message["id"]) if isinstance(message, dict) else None)

    async def edit(self, source: SessionSource, message_id: str, text: str) -> SendResult:
        """Replace the content of message ``message_id`` in the chat of ``source``."""
        path = f"/channels/{_channel(source)}/messages/{message_id}"
        _, result = await self._call("PATCH", path, {"content": text})
        return result

    async def typing(self, source: SessionSource) -> None:
        """Show "typing" in the channel or thread of ``source``; a failure is logged."""
        _, result = await self._call("POST", f"/channels/{_channel(source)}/typing", None)
        if not result.ok:
            logger.info("discord: the typing indicator failed (%s)", result.error)

    async def _call(
        self, method: str, path: str, body: Any
    ) -> tuple[httpx.Response | None, SendResult]:
        try:
            response = await self.rest.call(method, path, json=body)
        except RateLimitedError as exc:
            return None, http_failure(429, str(exc), exc.wait)
        except httpx.HTTPError as exc:
            return None, transport_failure(exc)
        if response.is_success:
            return response, SendResult(ok=True)
        return response, _refused(response)
