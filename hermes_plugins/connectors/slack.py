"""The Slack connector: the Events API over HTTP in, ``chat.postMessage`` out.

Every request to the route is checked as Slack documents it before anything else: the
``X-Slack-Signature`` header must be ``v0=`` and the hex HMAC-SHA256, keyed with the app's
signing secret, of ``v0:<X-Slack-Request-Timestamp>:<body>``, and the timestamp within five
minutes of now (an old request replayed is refused); otherwise 401, and nothing is read or
stored. Then a ``url_verification`` request gets its challenge back; an ``event_callback`` is
read (:mod:`hermes_plugins.readers.slack`) and answered 200 once stored, 503 when it could not
be, so that Slack delivers it again (``X-Slack-Retry-Num``: the gateway's redelivery records
answer it once, its message id being the event's ``ts``). A slash command (a form-encoded POST)
is stored the same way and acknowledged with an empty 200, its answer posted in its channel.
Storing takes milliseconds, and the turn runs after the answer: Slack's three seconds are kept.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field

from hermes_core.domain.connectors import (
    ConnectorContext,
    Inbox,
    WebhookRoute,
    WebRequest,
    WebResponse,
)
from hermes_core.domain.models import MessageEvent
from hermes_plugins.connectors.base import accept_payload, json_object
from hermes_plugins.connectors.slack_api import SlackAdapter

__all__ = ["SlackConnector", "SlackSettings", "build", "signed_by_slack", "slack_signature"]

MAX_SKEW_SECS = 300
"""How far a request's timestamp may be from now: Slack's five minutes."""

_FORM = "application/x-www-form-urlencoded"


class SlackSettings(BaseModel):
    """The Slack connector's keys of ``platforms.slack``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    token_env: str = Field(
        "SLACK_BOT_TOKEN",
        min_length=1,
        description="the environment variable holding the Bot User OAuth Token (xoxb-...)",
    )
    signing_secret_env: str = Field(
        "SLACK_SIGNING_SECRET",
        min_length=1,
        description="the environment variable holding the app's signing secret",
    )
    api_base: str = Field(
        "https://slack.com/api",
        pattern=r"^https?://",
        description="the Web API's base URL (http:// or https://)",
    )
    webhook_path: str = Field(
        "/slack",
        pattern=r"^/",
        description="the path of the Events API request URL in the app (starting with /)",
    )


def slack_signature(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Slack-Signature`` Slack computes for ``body`` sent at ``timestamp``."""
    base = b"v0:" + timestamp.encode("utf-8") + b":" + body
    return "v0=" + hmac.new(secret.encode("utf-8"), base, hashlib.sha256).hexdigest()


def signed_by_slack(request: WebRequest, secret: str, now: Callable[[], float] = time.time) -> bool:
    """Whether ``request`` carries Slack's signature, made within five minutes of now."""
    timestamp = request.header("x-slack-request-timestamp")
    signature = request.header("x-slack-signature")
    if not timestamp or not signature or not timestamp.isdigit():
        return False
    if abs(now() - int(timestamp)) > MAX_SKEW_SECS:
        return False
    expected = slack_signature(secret, timestamp, request.body)
    return hmac.compare_digest(expected.encode("utf-8"), signature.encode("utf-8", "replace"))


class SlackConnector:
    """Slack over the Events API; see the module docstring."""

    platform = "slack"

    def __init__(self, context: ConnectorContext, settings: SlackSettings) -> None:
        self._context = context
        self._settings = settings
        self._secret = context.secret(settings.signing_secret_env, "signing_secret_env")
        token = context.secret(settings.token_env, "token_env")
        self.adapter = SlackAdapter(settings.api_base, token)
        self.routes: Sequence[WebhookRoute] = (WebhookRoute(settings.webhook_path, self.handle),)
        self._inbox: Inbox | None = None

    def _read(self, payload: Mapping[str, Any]) -> MessageEvent | None:
        return self._context.read_event(payload)

    async def handle(self, request: WebRequest) -> WebResponse:
        """The answer to one request of Slack's (see the module docstring)."""
        if not signed_by_slack(request, self._secret):
            return WebResponse.text(401, "the request is not signed by Slack")
        content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
        if content_type == _FORM:
            return await self._slash_command(request.body)
        payload = json_object(request.body)
        if isinstance(payload, WebResponse):
            return payload
        if payload.get("type") == "url_verification":
            return WebResponse.text(200, str(payload.get("challenge", "")))
        return await accept_payload(payload, self._read, self._inbox)

    async def _slash_command(self, body: bytes) -> WebResponse:
        """A slash command's form, stored; an empty 200 shows the user nothing (the reply
        follows as a message), anything else is shown to the user as Slack's error."""
        try:
            fields = dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except (UnicodeDecodeError, ValueError):
            return WebResponse.text(400, "the body is not a form")
        answer = await accept_payload(fields, self._read, self._inbox)
        return WebResponse(200) if answer.status == 200 else answer

    async def start(self, inbox: Inbox) -> None:
        """Check the bot token (``auth.test``), then take events."""
        source = self._context.config.source
        where = f"platforms.{self.platform}"
        await self.adapter.connect(f"{where}.token_env", f"{where}.api_base", source)
        self._inbox = inbox

    async def stop(self) -> None:
        """Stop taking events (503 from now on: Slack delivers them again) and close."""
        self._inbox = None
        await self.adapter.close()

    def status(self) -> str:
        identity = f" as {self.adapter.identity}" if self.adapter.identity else ""
        return (
            f"slack: Events API at POST {self._settings.webhook_path}, replies through "
            f"{self._settings.api_base}{identity}"
        )


def build(context: ConnectorContext) -> SlackConnector:
    """The Slack connector of ``context``'s ``platforms.slack`` section."""
    return SlackConnector(context, context.settings_as(SlackSettings))
