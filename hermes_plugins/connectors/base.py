"""What every built-in connector shares: taking a webhook's event, sending a reply in parts, and
turning the platform API's answers into the ledger's failure kinds.

Imported only when a connector is built (it needs ``httpx``, from the ``serve`` extra), never by
the platform plugins' registration.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
from cachetools import LRUCache

from hermes_core.domain.connectors import Inbox, WebResponse
from hermes_core.domain.errors import MalformedEventError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent, SessionSource
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.ledger import SendResult

__all__ = [
    "API_CALLS", "API_TIMEOUT", "PartSender", "accept_event", "accept_payload", "api_client",
    "http_failure", "json_body", "json_object", "retry_after", "transport_failure",
]  # fmt: skip

logger = logging.getLogger(__name__)

API_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
"""Timeouts of a call to a platform's API (a long poll sets its own read timeout)."""

API_CALLS = 32
"""Calls to one platform's API in flight at once; the others wait their turn here. httpx's pool
scans its whole queue of waiting requests each time a connection frees up, so hundreds of
replies handed to it at once cost time quadratic in their number; waiting here costs nothing."""

_REMEMBERED_REPLIES = 4096
"""Replies whose delivered parts a connector remembers, so that sending one again (after a
part failed) starts at the first part that did not arrive."""


class _Bounded(httpx.AsyncBaseTransport):
    """A transport letting :data:`API_CALLS` requests (and the reading of their answers) through
    at once."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self._slots = asyncio.Semaphore(API_CALLS)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async with self._slots:
            response = await self._inner.handle_async_request(request)
            body = await response.aread()  # read here: the connection is free once released
            await response.aclose()
        return httpx.Response(
            response.status_code, headers=response.headers, content=body,
            extensions=response.extensions,
        )  # fmt: skip

    async def aclose(self) -> None:
        await self._inner.aclose()


def api_client(base_url: str, headers: Mapping[str, str] | None = None) -> httpx.AsyncClient:
    """An HTTP client for one platform's API: :data:`API_TIMEOUT`, at most :data:`API_CALLS`
    calls in flight, their connections kept alive between calls."""
    limits = httpx.Limits(max_connections=API_CALLS, max_keepalive_connections=API_CALLS)
    transport = _Bounded(httpx.AsyncHTTPTransport(limits=limits))
    return httpx.AsyncClient(
        base_url=base_url, headers=dict(headers or {}), timeout=API_TIMEOUT, transport=transport
    )


def json_body(body: bytes) -> Any:
    """The JSON value in a request body; ``ValueError`` when it is not JSON."""
    return json.loads(body.decode("utf-8"))


def json_object(body: bytes) -> Mapping[str, Any] | WebResponse:
    """The JSON object in a webhook request's body, or the 400 answer for a body that is not
    one."""
    try:
        payload = json_body(body)
    except ValueError:
        return WebResponse.text(400, "the body is not JSON")
    if not isinstance(payload, Mapping):
        return WebResponse.text(400, "the body is not a JSON object")
    return payload


async def accept_event(
    body: bytes, read: Callable[[Mapping[str, Any]], MessageEvent | None], inbox: Inbox | None
) -> WebResponse:
    """The answer to a webhook POST carrying one event, after storing it: 400 for a body that
    is not a JSON object, else :func:`accept_payload`'s answer."""
    payload = json_object(body)
    if isinstance(payload, WebResponse):
        return payload
    return await accept_payload(payload, read, inbox)


async def accept_payload(
    payload: Mapping[str, Any],
    read: Callable[[Mapping[str, Any]], MessageEvent | None],
    inbox: Inbox | None,
) -> WebResponse:
    """The answer to a webhook's decoded payload, after storing its event: 200 once stored, or
    for what is not a user message or cannot be read (the platform would only deliver it
    again); 503 while the gateway cannot store it, so that the platform delivers it again later.
    The crash point ``connector_before_ack`` lies between storing and answering."""
    try:
        event = read(payload)
    except MalformedEventError as exc:
        logger.warning("ignored a payload that cannot be read: %s", exc)
        return WebResponse.text(200, "ignored")
    if event is None:
        return WebResponse.text(200, "ignored")
    if inbox is None:
        return WebResponse.text(503, "not started")
    try:
        await inbox.handle_message(event)
    except MessageNotStoredError:
        return WebResponse.text(503, "not stored; deliver it again")
    crash_point("connector_before_ack")
    return WebResponse.text(200, "stored")


def retry_after(value: object) -> float | None:
    """Seconds to wait from a ``Retry-After`` header or a ``retry_after`` field; None when
    absent or not a non-negative number."""
    try:
        seconds = float(str(value))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def transport_failure(exc: httpx.HTTPError) -> SendResult:
    """A send that never got an answer (no connection, a timeout): ``disconnected``."""
    return SendResult(ok=False, failure_kind="disconnected", error=type(exc).__name__)


def http_failure(status: int, error: str, wait: float | None = None) -> SendResult:
    """A refused send by HTTP status: 429 ``rate_limited`` (after ``wait``), 401/403/404
    ``permanent`` (the token, the bot's access or the chat is gone: trying again cannot help),
    5xx ``disconnected`` (the platform is down), the other 4xx ``rejected``."""
    if status == 429:
        return SendResult(ok=False, failure_kind="rate_limited", error=error, retry_after=wait)
    if status in (401, 403, 404):
        return SendResult(ok=False, failure_kind="permanent", error=error)
    if status >= 500:
        return SendResult(ok=False, failure_kind="disconnected", error=error)
    return SendResult(ok=False, failure_kind="rejected", error=error)


class PartSender:
    """Sends a reply as the parts a platform accepts, in order, and remembers (in memory) the
    parts that arrived: sending the same reply again after a part failed goes on from the
    first part that did not arrive instead of repeating the ones above it."""

    def __init__(self, split: Callable[[str], Sequence[str]]) -> None:
        self._split = split
        self._delivered: LRUCache[tuple[str, str | None, str], int] = LRUCache(_REMEMBERED_REPLIES)

    async def send(
        self,
        source: SessionSource,
        text: str,
        send_part: Callable[[str, int], Awaitable[SendResult]],
    ) -> SendResult:
        """Send ``text`` to ``source``'s chat; ``send_part(part, index)`` sends one part. The
        first failure is the result; success once every part arrived."""
        memo = (source.chat_id, source.thread_id, text)
        parts = self._split(text)
        for index in range(self._delivered.get(memo, 0), len(parts)):
            result = await send_part(parts[index], index)
            if not result.ok:
                return result
            self._delivered[memo] = index + 1
        self._delivered.pop(memo, None)
        return SendResult(ok=True)
