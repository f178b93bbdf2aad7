"""A webhook connector for the app and serve tests, on the generic ``matrix`` platform: each
POST carries one JSON object ``{"chat", "text", "id"}`` (``{"ignore": true}`` is no message)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hermes_core import (
    InMemoryAdapter,
    MessageEvent,
    SessionSource,
    WebhookRoute,
    WebRequest,
    WebResponse,
)
from hermes_core.domain.connectors import Inbox
from hermes_plugins.connectors.base import accept_event


def _read(payload: Mapping[str, Any]) -> MessageEvent | None:
    if payload.get("ignore"):
        return None
    source = SessionSource(
        platform="matrix", chat_id=str(payload["chat"]), chat_type="dm", user_id="u1"
    )
    return MessageEvent(source=source, text=str(payload["text"]), message_id=str(payload["id"]))


class HookConnector:
    """A webhook connector for tests: one JSON object per POST, read by :func:`_read`."""

    platform = "matrix"

    def __init__(self) -> None:
        self.adapter = InMemoryAdapter("matrix")
        self.inbox: Inbox | None = None
        self.routes: Sequence[WebhookRoute] = (
            WebhookRoute("/matrix", self._post),
            WebhookRoute("/matrix/boom", self._boom),
        )

    async def _post(self, request: WebRequest) -> WebResponse:
        return await accept_event(request.body, _read, self.inbox)

    async def _boom(self, request: WebRequest) -> WebResponse:
        raise RuntimeError("secret-token-123 leaked in a traceback")

    async def start(self, inbox: Inbox) -> None:
        self.inbox = inbox

    async def stop(self) -> None:
        self.inbox = None

    def status(self) -> str:
        return "matrix: webhook /matrix"
