"""The WhatsApp Cloud API connector: Meta's webhook in, ``/<phone-number-id>/messages`` out.

Events arrive at one route (``webhook_path``, default ``/whatsapp``). A GET is Meta's
verification handshake: ``hub.mode=subscribe`` with ``hub.verify_token`` equal to the verify
token is answered with ``hub.challenge``, anything else 403. A POST must carry
``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the raw body, keyed by the app secret>``, else
it is a 401 that touches nothing. A POST may batch several messages: each is stored on its own,
in order, and the POST is answered 200 only once all of them are; a message that cannot be stored
makes it a 503, so that Meta delivers the whole body again (the messages stored before it are
then recognised as redeliveries and answered once). Status callbacks (``statuses``) carry no
message and are answered 200.

Replies are sent as text messages from the configured business number (``phone_number_id``, also
for webhooks that name another number of the same app) to the user's WhatsApp id, the first part
quoting the triggering message (``context.message_id``), split at 4,096 characters. Meta's error
codes become the ledger's failure kinds (:func:`cloud_failure`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from hermes_core.domain.connectors import (
    ConnectorContext,
    Inbox,
    WebhookRoute,
    WebRequest,
    WebResponse,
)
from hermes_core.domain.errors import ConfigError, MalformedEventError
from hermes_core.domain.models import SessionSource
from hermes_core.domain.splitting import split_reply
from hermes_core.turns.ledger import SendResult
from hermes_plugins.connectors.base import (
    PartSender,
    accept_payload,
    api_client,
    http_failure,
    json_object,
    transport_failure,
)
from hermes_plugins.readers.whatsapp import split_cloud_webhook

__all__ = ["MAX_TEXT", "WhatsAppConnector", "WhatsAppSettings", "cloud_failure"]

logger = logging.getLogger(__name__)

MAX_TEXT = 4096
"""The longest text message body the Cloud API accepts, in characters."""

RATE_LIMITED = frozenset({4, 80007, 130429, 131048, 131056})
"""Meta's codes for a rate limit: the app's, the account's, the number's throughput, the spam
limit, and too many messages to one user."""
PERMANENT = {
    0: "the access token was refused",
    190: "the access token expired or was revoked",
    10: "the app lacks the whatsapp_business_messaging permission",
    368: "the business account is blocked for a policy violation",
    131031: "the business account is locked",
    131026: "the recipient cannot receive this message (not a WhatsApp user, or blocked)",
    131047: (
        "more than 24 hours passed since the user's last message: outside the customer-service "
        "window WhatsApp accepts only an approved template message, which this connector does "
        "not send"
    ),
}
"""Meta's codes that no retry can fix, and what they mean for the operator."""
UNAVAILABLE = frozenset({1, 2, 131000, 131016})
"""Meta's codes for a platform that is down or overloaded (tried again like a lost connection)."""


class WhatsAppSettings(BaseModel):
    """The ``platforms.whatsapp`` keys this connector reads (the host's other keys are kept)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    phone_number_id: str = Field(
        pattern=r"^[0-9]+$",
        description="the business phone number's id (digits), from the app's WhatsApp API Setup",
    )
    access_token_env: str = Field(
        "WHATSAPP_ACCESS_TOKEN",
        min_length=1,
        description="the environment variable holding the access token (a system user's)",
    )
    app_secret_env: str = Field(
        "WHATSAPP_APP_SECRET",
        min_length=1,
        description="the environment variable holding the app secret that signs webhook POSTs",
    )
    verify_token_env: str = Field(
        "WHATSAPP_VERIFY_TOKEN",
        min_length=1,
        description="the environment variable holding the verify token typed into Meta's "
        "webhook configuration",
    )
    api_base: str = Field(
        "https://graph.facebook.com/v21.0",
        pattern=r"^https?://",
        description="the Graph API's base URL with its version, http(s)://...",
    )
    webhook_path: str = Field(
        "/whatsapp", pattern=r"^/", description="the webhook route's path, starting with /"
    )
    rate_limit_wait_secs: float | None = Field(
        None,
        gt=0,
        description="seconds before a rate-limited reply is sent again (a positive number); "
        "unset: the gateway's backoff",
    )


def cloud_failure(status: int, answer: Any, wait: float | None = None) -> SendResult:
    """A refused send from the HTTP status and Meta's error object (``{"error": {"code": ...}}``):
    rate-limit codes ``rate_limited`` (after ``wait``), the 24-hour window (131047), an
    undeliverable recipient, a refused token or a blocked account ``permanent``, an unavailable
    platform ``disconnected``, the others ``rejected``; without a code, by HTTP status."""
    error = answer.get("error") if isinstance(answer, Mapping) else None
    code = error.get("code") if isinstance(error, Mapping) else None
    if not isinstance(code, int) or isinstance(code, bool):
        return http_failure(status, f"HTTP {status}", wait)
    message = error.get("message") if isinstance(error, Mapping) else None
    text = f"WhatsApp error {code}: {message or 'no message'}"
    if code in RATE_LIMITED:
        return SendResult(ok=False, failure_kind="rate_limited", error=text, retry_after=wait)
    if code in PERMANENT or 200 <= code <= 299:
        reason = PERMANENT.get(code, "the app lacks a permission")
        return SendResult(ok=False, failure_kind="permanent", error=f"{text} ({reason})")
    if code in UNAVAILABLE or status >= 500:
        return SendResult(ok=False, failure_kind="disconnected", error=text)
    return SendResult(ok=False, failure_kind="rejected", error=text)


class WhatsAppConnector:
    """Meta's webhook route and a Cloud API sender for one business number; it is its own
    adapter (``adapter is self``)."""

    platform = "whatsapp"

    def __init__(self, context: ConnectorContext) -> None:
        self.settings = context.settings_as(WhatsAppSettings)
        settings = self.settings
        self._token = context.secret(settings.access_token_env, "access_token_env")
        self._app_secret = context.secret(settings.app_secret_env, "app_secret_env").encode()
        self._verify_token = context.secret(settings.verify_token_env, "verify_token_env")
        self._read = context.read_event
        self._source = context.config.source
        self._parts = PartSender(lambda text: split_reply(text, MAX_TEXT))
        self._client: httpx.AsyncClient | None = None
        self._inbox: Inbox | None = None
        self._number = ""
        self.adapter = self
        self.routes: Sequence[WebhookRoute] = (
            WebhookRoute(settings.webhook_path, self.handle, ("GET", "POST")),
        )

    async def start(self, inbox: Inbox) -> None:
        """Check the access token on the business number (``GET /<phone-number-id>``), then
        take events. A refused token is a ``ConfigError``; an unreachable API (or a 5xx) only a
        warning (webhooks are still stored; sends fail as ``disconnected`` until it answers)."""
        client = api_client(
            self.settings.api_base.rstrip("/"), {"Authorization": f"Bearer {self._token}"}
        )
        try:
            response = await client.get(f"/{self.settings.phone_number_id}")
        except httpx.HTTPError as exc:
            logger.warning("the WhatsApp Cloud API did not answer at start: %s", type(exc).__name__)
        else:
            if response.is_server_error:
                logger.warning("the WhatsApp Cloud API answered HTTP %d at start",
                               response.status_code)  # fmt: skip
            elif response.is_error:
                await client.aclose()
                self._refused(response)
            else:
                self._number = str(_answer(response).get("display_phone_number") or "")
        self._client = client
        self._inbox = inbox

    def _refused(self, response: httpx.Response) -> None:
        """Raise the ``ConfigError`` for a number or token that the API refused at start."""
        failure = cloud_failure(response.status_code, _answer(response))
        key = "platforms.whatsapp.access_token_env"
        raise ConfigError(
            key, f"the WhatsApp Cloud API refused the access token in "
            f"{self.settings.access_token_env} for phone number id "
            f"{self.settings.phone_number_id} ({failure.error}); set a valid token, or fix "
            "platforms.whatsapp.phone_number_id.", source=self._source,
        )  # fmt: skip

    async def stop(self) -> None:
        """Stop taking events (POSTs get 503: Meta delivers them again) and close the client."""
        self._inbox = None
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def status(self) -> str:
        """How events arrive and which number answers."""
        number = f" (+{self._number.lstrip('+')})" if self._number else ""
        return (
            f"whatsapp: webhook {self.settings.webhook_path}, replies from phone number id "
            f"{self.settings.phone_number_id}{number} via {self.settings.api_base}"
        )

    def is_connected(self) -> bool:
        """Whether sends can be attempted (between start and stop)."""
        return self._client is not None

    async def handle(self, request: WebRequest) -> WebResponse:
        """The webhook route: the GET handshake or a signed POST."""
        if request.method == "GET":
            return self._verify(request)
        if not self._signed(request):
            return WebResponse.text(401, "the X-Hub-Signature-256 signature does not match")
        return await self._receive(request.body)

    def _verify(self, request: WebRequest) -> WebResponse:
        """Meta's verification request: the challenge back when the mode and token match."""
        token = request.query.get("hub.verify_token", "")
        challenge = request.query.get("hub.challenge")
        if request.query.get("hub.mode") != "subscribe" or not hmac.compare_digest(
            token.encode(), self._verify_token.encode()
        ):
            return WebResponse.text(403, "the verify token does not match")
        if challenge is None:
            return WebResponse.text(400, "hub.challenge is missing")
        return WebResponse.text(200, challenge)

    def _signed(self, request: WebRequest) -> bool:
        """Whether ``X-Hub-Signature-256`` is the body's HMAC-SHA256 under the app secret."""
        given = request.header("x-hub-signature-256") or ""
        expected = "sha256=" + hmac.new(self._app_secret, request.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(given.strip().lower().encode(), expected.encode())

    async def _receive(self, body: bytes) -> WebResponse:
        """Store every message of a signed POST, in order; 200 once all are stored."""
        payload = json_object(body)
        if isinstance(payload, WebResponse):
            return payload
        try:
            parts = split_cloud_webhook(payload)
        except MalformedEventError as exc:
            logger.warning("ignored a webhook that cannot be read: %s", exc)
            return WebResponse.text(200, "ignored")
        for part in parts:
            answer = await accept_payload(part, self._read, self._inbox)
            if answer.status != 200:
                return answer
        return WebResponse.text(200, f"{len(parts)} message(s) taken")

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` to the user of ``source`` (its chat id, the user's WhatsApp id), in
        parts of at most 4,096 characters, the first quoting ``reply_to``."""
        client = self._client
        if client is None:
            return SendResult(ok=False, failure_kind="disconnected", error="not started")
        path = f"/{self.settings.phone_number_id}/messages"

        async def send_part(part: str, index: int) -> SendResult:
            message: dict[str, Any] = {
                "messaging_product": "whatsapp",
                "recipient_type": "individual",
                "to": source.chat_id,
                "type": "text",
                "text": {"body": part, "preview_url": False},
            }
            if reply_to and index == 0:
                message["context"] = {"message_id": reply_to}
            try:
                response = await client.post(path, json=message)
            except httpx.HTTPError as exc:
                return transport_failure(exc)
            if response.is_success:
                return SendResult(ok=True)
            wait = self.settings.rate_limit_wait_secs
            return cloud_failure(response.status_code, _answer(response), wait)

        return await self._parts.send(source, text, send_part)


def _answer(response: httpx.Response) -> Mapping[str, Any]:
    """The JSON object a Graph API response carries; empty when it carries none."""
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, Mapping) else {}
