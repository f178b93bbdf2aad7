"""A fake Slack for the connector tests: the Web API's ``auth.test`` and ``chat.postMessage``
(a Starlette app to serve with :class:`~support.loopback.LoopbackServer`), and Slack's side of
the Events API: event bodies and the headers Slack signs them with (or forged, or old ones).

The fake keeps what ``chat.postMessage`` received (channel, thread_ts, text) and answers from a
script: ``fail_next`` queues answers (a 429 with ``Retry-After``, an ``ok: false`` error) for the
next calls before it delivers again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

TOKEN = "xoxb-fake-bot-token"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TEAM = "T0FAKE"


@dataclass(frozen=True)
class Posted:
    """One message that ``chat.postMessage`` accepted."""

    channel: str
    thread_ts: str | None
    text: str


@dataclass(frozen=True)
class Failure:
    """A scripted answer: HTTP ``status`` with ``error`` (``ok: false``) and ``retry_after``."""

    error: str
    status: int = 200
    retry_after: int | None = None


@dataclass
class FakeSlack:
    """The fake Web API's state; ``app`` serves it under ``/api``."""

    token: str = TOKEN
    posted: list[Posted] = field(default_factory=list)
    calls: list[tuple[str, float]] = field(default_factory=list)
    """Every Web API call: (method, monotonic time)."""
    script: list[Failure] = field(default_factory=list)
    auth_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/api/auth.test", self._auth_test, methods=["POST"]),
                Route("/api/chat.postMessage", self._post_message, methods=["POST"]),
            ]
        )

    @property
    def texts(self) -> list[str]:
        return [message.text for message in self.posted]

    def fail_next(self, *failures: Failure) -> None:
        """Answer the next ``chat.postMessage`` calls with ``failures``, in order."""
        with self._lock:
            self.script.extend(failures)

    def _authorised(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.token}"

    async def _auth_test(self, request: Request) -> JSONResponse:
        self.calls.append(("auth.test", time.monotonic()))
        if self.auth_error or not self._authorised(request):
            return JSONResponse({"ok": False, "error": self.auth_error or "invalid_auth"})
        return JSONResponse({"ok": True, "user": "hermes", "team": "Fake Team", "team_id": TEAM})

    async def _post_message(self, request: Request) -> JSONResponse:
        self.calls.append(("chat.postMessage", time.monotonic()))
        if not self._authorised(request):
            return JSONResponse({"ok": False, "error": "not_authed"})
        if request.headers.get("content-type", "").split(";")[0] != "application/json":
            return JSONResponse({"ok": False, "error": "invalid_form_data"})
        body = await request.json()
        with self._lock:
            failure = self.script.pop(0) if self.script else None
        if failure is not None:
            headers = (
                {} if failure.retry_after is None else {"Retry-After": str(failure.retry_after)}
            )
            return JSONResponse(
                {"ok": False, "error": failure.error}, status_code=failure.status, headers=headers
            )
        if not body.get("channel") or not body.get("text"):
            return JSONResponse({"ok": False, "error": "no_text"})
        self.posted.append(Posted(body["channel"], body.get("thread_ts"), body["text"]))
        return JSONResponse({"ok": True, "channel": body["channel"], "ts": f"{time.time():.6f}"})


def message_event(
    text: str,
    ts: str,
    *,
    channel: str = "C0GENERAL",
    user: str = "U0ANA",
    thread_ts: str | None = None,
    channel_type: str = "channel",
    event_id: str | None = None,
) -> dict[str, Any]:
    """An Events API ``event_callback`` body carrying one ``message`` event."""
    event: dict[str, Any] = {
        "type": "message", "channel": channel, "user": user, "text": text, "ts": ts,
        "channel_type": channel_type,
    }  # fmt: skip
    if thread_ts is not None:
        event["thread_ts"] = thread_ts
    return {
        "token": "deprecated-verification-token", "team_id": TEAM, "api_app_id": "A0FAKE",
        "type": "event_callback", "event": event, "event_time": int(float(ts)),
        "event_id": event_id or f"Ev{ts.replace('.', '')}",
    }  # fmt: skip


def signed_headers(
    body: bytes,
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
    retry: int | None = None,
    content_type: str = "application/json",
) -> dict[str, str]:
    """The headers Slack sends ``body`` with: its signature (``v0=`` and the hex HMAC-SHA256 of
    ``v0:<timestamp>:<body>`` keyed with ``secret``), and the retry headers of a redelivery."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    digest = hmac.new(secret.encode(), b"v0:" + stamp.encode() + b":" + body, hashlib.sha256)
    headers = {
        "Content-Type": content_type,
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": "v0=" + digest.hexdigest(),
    }
    if retry is not None:
        headers["X-Slack-Retry-Num"] = str(retry)
        headers["X-Slack-Retry-Reason"] = "http_error"
    return headers


def encode(body: dict[str, Any]) -> bytes:
    """A body as Slack sends it (compact JSON)."""
    return json.dumps(body, separators=(",", ":")).encode()
