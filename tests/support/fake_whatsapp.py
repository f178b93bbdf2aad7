"""A fake WhatsApp Cloud API (run it with :class:`support.loopback.LoopbackServer`) and Meta's
side of the webhook: bodies in the documented shape, signed as Meta signs them.

The fake answers ``GET /<phone-number-id>`` (the number's details) and records what
``POST /<phone-number-id>/messages`` receives; it can be told to refuse the next sends with one
of Meta's error codes (:meth:`FakeCloudApi.fail_next`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

PHONE_NUMBER_ID = "106540352242922"
DISPLAY_NUMBER = "15550783881"
ACCESS_TOKEN = "test-access-token"
APP_SECRET = "test-app-secret"
VERIFY_TOKEN = "test-verify-token"
ENVIRON = {
    "WHATSAPP_ACCESS_TOKEN": ACCESS_TOKEN,
    "WHATSAPP_APP_SECRET": APP_SECRET,
    "WHATSAPP_VERIFY_TOKEN": VERIFY_TOKEN,
}
"""The connector's secrets under their default variable names."""


@dataclass(frozen=True)
class Sent:
    """One send the fake received: to whom, the text, the quoted message, whether it was
    accepted (a refused one is recorded too)."""

    to: str
    text: str
    reply_to: str | None
    accepted: bool


class FakeCloudApi:
    """The Graph API endpoints the connector calls, for one business number."""

    def __init__(self, phone_number_id: str = PHONE_NUMBER_ID, token: str = ACCESS_TOKEN) -> None:
        self.phone_number_id = phone_number_id
        self.token = token
        self.attempts: list[Sent] = []
        self.down = False
        """While set, every request is answered 503 (Meta's code 2), as in an outage."""
        self._failures: list[tuple[int, int]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[
                Route("/{number}", self._number, methods=["GET"]),
                Route("/{number}/messages", self._messages, methods=["POST"]),
            ]
        )

    def fail_next(self, code: int, *, status: int = 400, times: int = 1) -> None:
        """Refuse the next ``times`` sends with Meta's error ``code`` and HTTP ``status``."""
        with self._lock:
            self._failures.extend([(status, code)] * times)

    def sent(self) -> list[Sent]:
        """The sends it accepted, in order."""
        with self._lock:
            return [sent for sent in self.attempts if sent.accepted]

    def texts(self) -> list[str]:
        """The texts of the accepted sends."""
        return [sent.text for sent in self.sent()]

    def wait_for(self, count: int, timeout: float = 15.0) -> list[Sent]:
        """The accepted sends once there are ``count`` (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(sent := self.sent()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} sends, the fake received {sent}")
            time.sleep(0.02)
        return sent

    def _refusal(self, request: Request) -> JSONResponse | None:
        """Meta's answer to a bad token or another business number, or while ``down``; None
        when the request may go on."""
        if self.down:
            return _error(503, 2, "Service temporarily unavailable")
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, 190, "Error validating access token")
        if request.path_params["number"] != self.phone_number_id:
            return _error(400, 100, "Unsupported post request")
        return None

    async def _number(self, request: Request) -> JSONResponse:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        details = {"display_phone_number": DISPLAY_NUMBER, "verified_name": "Test Business"}
        return JSONResponse({**details, "id": self.phone_number_id})

    async def _messages(self, request: Request) -> JSONResponse:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        body = await request.json()
        assert body["messaging_product"] == "whatsapp", body
        assert body["type"] == "text", body
        with self._lock:
            failure = self._failures.pop(0) if self._failures else None
            context = body.get("context") or {}
            sent = Sent(body["to"], body["text"]["body"], context.get("message_id"), not failure)
            self.attempts.append(sent)
            message_id = f"wamid.sent{next(self._ids)}"
        if failure is not None:
            return _error(failure[0], failure[1], f"error {failure[1]}")
        return JSONResponse(
            {
                "messaging_product": "whatsapp",
                "contacts": [{"input": body["to"], "wa_id": body["to"]}],
                "messages": [{"id": message_id}],
            }
        )


def _error(status: int, code: int, message: str) -> JSONResponse:
    """A Graph API error answer."""
    error = {"message": f"({code}) {message}", "type": "OAuthException", "code": code,
             "error_data": {"messaging_product": "whatsapp", "details": message},
             "fbtrace_id": "AbCdEf"}  # fmt: skip
    return JSONResponse({"error": error}, status_code=status)


def text_message(wa_id: str, text: str, message_id: str) -> dict[str, Any]:
    """One inbound text message of a webhook's ``messages``."""
    return {"from": wa_id, "id": message_id, "timestamp": "1764900000", "type": "text",
            "text": {"body": text}}  # fmt: skip


def webhook_body(*messages: dict[str, Any], statuses: list[dict[str, Any]] | None = None) -> bytes:
    """A ``messages`` webhook body as Meta sends it: one entry, one change, the senders'
    ``contacts`` and the ``messages`` (or only ``statuses``)."""
    value: dict[str, Any] = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": DISPLAY_NUMBER, "phone_number_id": PHONE_NUMBER_ID},
    }
    if messages:
        senders = dict.fromkeys(message["from"] for message in messages)
        value["contacts"] = [{"profile": {"name": f"User {n}"}, "wa_id": n} for n in senders]
        value["messages"] = list(messages)
    if statuses:
        value["statuses"] = statuses
    change = {"field": "messages", "value": value}
    entry = {"id": "102290129340398", "changes": [change]}
    return json.dumps({"object": "whatsapp_business_account", "entry": [entry]}).encode()


def status_body(message_id: str, wa_id: str) -> bytes:
    """A status callback: a sent message was delivered."""
    status = {"id": message_id, "status": "delivered", "timestamp": "1764900001",
              "recipient_id": wa_id}  # fmt: skip
    return webhook_body(statuses=[status])


def signed_headers(body: bytes, secret: str = APP_SECRET) -> dict[str, str]:
    """The headers of Meta's POST: the body's ``X-Hub-Signature-256`` under ``secret`` (pass
    another secret to forge one)."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"content-type": "application/json", "x-hub-signature-256": f"sha256={digest}"}
