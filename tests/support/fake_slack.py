"""A fake Slack for the connector tests: the Web API's ``auth.test``, ``chat.postMessage`` and
``chat.update`` (a Starlette app to serve with :class:`~support.loopback.LoopbackServer`), and
Slack's side of the Events API: event bodies and the headers Slack signs them with (or forged,
or old ones).

The fake keeps what ``chat.postMessage`` received (channel, thread_ts, text, under a new ``ts``),
replaces a message's text on ``chat.update`` (and records the update), and answers from a
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


@dataclass
class Posted:
    """One message that ``chat.postMessage`` accepted; ``text`` is its text now (after the
    updates)."""

    channel: str
    thread_ts: str | None
    text: str
    ts: str = ""


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
    """Answers of the next ``chat.postMessage`` and ``chat.update`` calls."""
    updates: list[tuple[str, str, str]] = field(default_factory=list)
    """Every ``chat.update`` accepted: (channel, ts, text)."""
    auth_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/api/auth.test", self._auth_test, methods=["POST"]),
                Route("/api/chat.postMessage", self._post_message, methods=["POST"]),
                Route("/api/chat.update", self._update, methods=["POST"]),
            ]
        )

    @property
    def texts(self) -> list[str]:
        return [message.text for message in self.posted]

    def fail_next(self, *failures: Failure) -> None:
        """Answer the next ``chat.postMessage`` or ``chat.update`` calls with ``failures``, in
        order."""
        with self._lock:
            self.script.extend(failures)

    def _authorised(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.token}"

    async def _auth_test(self, request: Request) -> JSONResponse:
        self.calls.append(("auth.test", time.monotonic()))
        if self.auth_error or not self._authorised(request):
            return JSONResponse({"ok": False, "error": self.auth_error or "invalid_auth"})
        return JSONResponse({"ok": True, "user": "hermes", "team": "Fake Team", "team_id": TEAM})

    async def _refusal(self, request: Request, method: str) -> JSONResponse | None:
        """The answer refusing a message call (its auth, its body, the script), if any."""
        self.calls.append((method, time.monotonic()))
        if not self._authorised(request):
            return JSONResponse({"ok": False, "error": "not_authed"})
        if request.headers.get("content-type", "").split(";")[0] != "application/json":
            return JSONResponse({"ok": False, "error": "invalid_form_data"})
        with self._lock:
            failure = self.script.pop(0) if self.script else None
        if failure is not None:
            headers = (
                {} if failure.retry_after is None else {"Retry-After": str(failure.retry_after)}
            )
            return JSONResponse(
                {"ok": False, "error": failure.error}, status_code=failure.status, headers=headers
            )
        return None

    async def _post_message(self, request: Request) -> JSONResponse:
        refusal = await self._refusal(request, "chat.postMessage")
        if refusal is not None:
            return refusal
        body = await request.json()
        if not body.get("channel") or not body.get("text"):
            return JSONResponse({"ok": False, "error": "no_text"})
        with self._lock:
            ts = f"{time.time():.0f}.{len(self.posted):06d}"
            self.posted.append(Posted(body["channel"], body.get("thread_ts"), body["text"], ts))
        return JSONResponse({"ok": True, "channel": body["channel"], "ts": ts})

    async def _update(self, request: Request) -> JSONResponse:
        refusal = await self._refusal(request, "chat.update")
        if refusal is not None:
            return refusal
        body = await request.json()
        if not body.get("text"):
            return JSONResponse({"ok": False, "error": "no_text"})
        with self._lock:
            found = [
                m for m in self.posted if (m.channel, m.ts) == (body.get("channel"), body.get("ts"))
            ]
            if not found:
                return JSONResponse({"ok": False, "error": "message_not_found"})
            found[0].text = body["text"]
            self.updates.append((body["channel"], body["ts"], body["text"]))
        return JSONResponse({"ok": True, "channel": body["channel"], "ts": body["ts"]})


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
