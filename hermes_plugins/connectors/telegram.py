"""The Telegram connector: updates arrive by long polling (``getUpdates``) or as webhook POSTs,
replies leave through ``sendMessage`` (:class:`~hermes_plugins.connectors.telegram_api.
TelegramAdapter`).

Acknowledgement: a polled update is confirmed to Telegram by the next ``getUpdates`` offset,
which moves past an update only once ``Inbox.handle_message`` returned for it (or it is not a
user message, or cannot be read). When the gateway cannot store it, the offset stays where it
is and the poller fetches the same updates again after a pause. A webhook POST is answered 200
only once stored, 503 when not (Telegram delivers it again), 401 without the secret token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from hermes_core.domain.connectors import (
    ConnectorContext,
    Inbox,
    WebhookRoute,
    WebRequest,
    WebResponse,
)
from hermes_core.domain.errors import ConfigError, MalformedEventError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent
from hermes_core.turns.crashpoints import crash_point
from hermes_plugins.connectors.base import accept_event, json_body
from hermes_plugins.connectors.telegram_api import BotApi, BotApiError, TelegramAdapter

__all__ = ["ALLOWED_UPDATES", "TelegramConnector", "TelegramSettings", "build_telegram"]

logger = logging.getLogger(__name__)

ALLOWED_UPDATES = ("message", "channel_post", "business_message", "callback_query")
"""The update kinds the Telegram reader reads; Telegram is asked for these only."""
SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
SECRET_CHARS = r"^[A-Za-z0-9_-]{1,256}$"
"""What ``setWebhook`` accepts as ``secret_token``."""
FIRST_PAUSE_SECS = 1.0
"""The first pause after a failed poll; it doubles up to ``retry_max_secs``."""
POLL_GRACE_SECS = 10.0
"""How much longer than the server-side ``timeout`` a long poll waits for its answer."""
CONFIRM_SECS = 5.0
"""How long a stopping poller waits to confirm the updates it stored."""


class TelegramSettings(BaseModel):
    """``platforms.telegram``: what the connector reads (other keys belong to the host)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    mode: Literal["polling", "webhook"] = Field("polling", description="one of: polling, webhook")
    token_env: str = Field(
        "TELEGRAM_BOT_TOKEN", min_length=1,
        description="the name of the environment variable holding the bot token",
    )  # fmt: skip
    api_base: str = Field(
        "https://api.telegram.org", pattern=r"^https?://\S+$",
        description="the Bot API's base URL (http(s)://...)",
    )  # fmt: skip
    poll_timeout_secs: int = Field(
        25, ge=1, le=50, description="whole seconds from 1 to 50 (getUpdates' timeout)"
    )
    retry_max_secs: float = Field(
        30.0, gt=0, le=600, description="seconds from 0 to 600 (the longest pause of a poller)"
    )
    parse_mode: Literal["MarkdownV2", "HTML", "Markdown"] | None = Field(
        None, description="one of: MarkdownV2, HTML, Markdown, or null for plain text"
    )
    webhook_path: str = Field(
        "/telegram", pattern=r"^/\S*$", description="a URL path starting with /"
    )
    webhook_secret_env: str = Field(
        "TELEGRAM_WEBHOOK_SECRET", min_length=1,
        description="the name of the environment variable holding the webhook's secret token",
    )  # fmt: skip


class TelegramConnector:
    """A Telegram bot: a long-polling task, or a webhook route; replies through ``adapter``."""

    platform = "telegram"

    def __init__(
        self,
        settings: TelegramSettings,
        token: str,
        read_event: Callable[[Mapping[str, Any]], MessageEvent | None],
        *,
        secret: str | None = None,
        public_url: str | None = None,
        source: str | None = None,
    ) -> None:
        self.settings = settings
        self._source = source
        """The configuration file, named in errors."""
        self.adapter = TelegramAdapter(BotApi(settings.api_base, token), settings.parse_mode)
        self.routes = [WebhookRoute(settings.webhook_path, self._webhook)] if secret else []
        self._read = read_event
        self._secret = (secret or "").encode("utf-8")
        self._webhook_url = public_url.rstrip("/") + settings.webhook_path if public_url else None
        self._inbox: Inbox | None = None
        self._poller: asyncio.Task[None] | None = None
        self._offset: int | None = None
        self._waiting = False
        """The poller waits (a long poll, a pause): stopping may cancel it there."""
        self._stopping = False
        self._username = "?"
        self._problem: str | None = None
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def api(self) -> BotApi:
        """The Bot API client (shared with the adapter)."""
        return self.adapter.api

    async def start(self, inbox: Inbox) -> None:
        """Check the token (``getMe``); register the webhook when there is a public URL, or
        start polling (refused while a webhook is set: Telegram answers only one of them). A
        refused token is a ``ConfigError``; a Bot API that does not answer (or answers 5xx)
        only a warning: the poller keeps trying, sends fail as ``disconnected`` meanwhile."""
        me = await self._start_call("getMe", {}) or {}
        self._username = str(me.get("username") or me.get("id") or "?")
        if self.routes and self._webhook_url:
            await self._start_call("setWebhook", {
                "url": self._webhook_url, "secret_token": self._secret.decode("utf-8"),
                "allowed_updates": list(ALLOWED_UPDATES),
            })  # fmt: skip
        elif not self.routes:
            hook = await self._start_call("getWebhookInfo", {}) or {}
            if hook.get("url"):
                raise ConfigError(
                    "platforms.telegram.mode", "Telegram has a webhook set for this bot "
                    f"({hook['url']}), so it cannot be polled; delete it (the Bot API's "
                    "deleteWebhook) or set platforms.telegram.mode: webhook.",
                    source=self._source,
                )  # fmt: skip
        self._inbox = inbox
        self._stopping = False
        self.adapter.connected = True
        if not self.routes:
            self._poller = asyncio.create_task(self._poll(), name="telegram-poller")

    async def _start_call(self, method: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """A call made while starting: its result; None (with a warning) when the Bot API did
        not answer or answered 5xx; a ``ConfigError`` in one sentence when it refused."""
        try:
            result = await self.api.call(method, params)
        except httpx.HTTPError as exc:
            logger.warning("the Telegram Bot API at %s did not answer %s at start (%s)",
                           self.api.api_base, method, type(exc).__name__)  # fmt: skip
            return None
        except BotApiError as exc:
            if exc.status >= 500:
                logger.warning("the Telegram Bot API answered %s with %s at start", method, exc)
                return None
            if exc.status in (401, 404):
                raise ConfigError(
                    "platforms.telegram.token_env", "Telegram refused the bot token in "
                    f"{self.settings.token_env} ({exc}); set it to the token @BotFather gave.",
                    source=self._source,
                ) from None  # fmt: skip
            raise ConfigError("platforms.telegram", f"Telegram refused {method} ({exc}).",
                              source=self._source) from None  # fmt: skip
        return result if isinstance(result, dict) else {}

    async def stop(self) -> None:
        """Stop taking updates: a poller finishes storing the update in hand, hands over no
        other and confirms what it stored; the webhook answers 503 from now on (Telegram
        delivers again later). Replies can still be sent (a drain's)."""
        self._stopping = True
        self._inbox = None
        poller, self._poller = self._poller, None
        if poller is not None:
            if self._waiting:
                poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            if self._offset is not None:
                with contextlib.suppress(BotApiError, httpx.HTTPError):
                    await self.api.call(
                        "getUpdates", {"offset": self._offset, "limit": 1, "timeout": 0},
                        read_timeout=CONFIRM_SECS,
                    )  # fmt: skip
        await self.api.close()

    def status(self) -> str:
        bot = f"@{self._username}"
        if self.routes:
            registered = (
                f"registered with setWebhook as {self._webhook_url}" if self._webhook_url
                else "not registered (no server.public_url): call setWebhook with its "
                "secret_token yourself"
            )  # fmt: skip
            return f"telegram: webhook {self.settings.webhook_path} as {bot}, {registered}"
        problem = f" ({self._problem})" if self._problem else ""
        return f"telegram: long polling {self.api.api_base} as {bot}{problem}"

    # -- webhook ----------------------------------------------------------------------------

    async def _webhook(self, request: WebRequest) -> WebResponse:
        """A POSTed update, checked against the secret token (constant-time) and stored."""
        given = (request.header(SECRET_HEADER) or "").encode("utf-8")
        if not hmac.compare_digest(given, self._secret):
            return WebResponse.text(401, "missing or wrong secret token")
        answer = await accept_event(request.body, self._read, self._inbox)
        if answer.status == 200 and b'"callback_query"' in request.body:
            self._answer_button(json_body(request.body))
        return answer

    def _answer_button(self, update: Any) -> None:
        """Answer a stored button press (``answerCallbackQuery``), so that the user's client
        stops showing it as pending; in the background, and a failure only logged."""
        query = update.get("callback_query") if isinstance(update, dict) else None
        if not isinstance(query, dict) or not query.get("id"):
            return
        task = asyncio.create_task(self._answer_query(str(query["id"])))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer_query(self, query_id: str) -> None:
        try:
            await self.api.call("answerCallbackQuery", {"callback_query_id": query_id})
        except (BotApiError, httpx.HTTPError) as exc:
            logger.info("a button press was not answered (%s)", exc)

    # -- long polling -----------------------------------------------------------------------

    async def _poll(self) -> None:
        """Fetch updates, hand each to the inbox, move the offset past the ones taken."""
        failures = 0
        timeout = self.settings.poll_timeout_secs
        while not self._stopping:
            params: dict[str, Any] = {"timeout": timeout, "allowed_updates": list(ALLOWED_UPDATES)}
            if self._offset is not None:
                params["offset"] = self._offset
            self._waiting = True
            try:
                updates = await self.api.call(
                    "getUpdates", params, read_timeout=timeout + POLL_GRACE_SECS
                )
            except (BotApiError, httpx.HTTPError) as exc:
                self._report(_poll_problem(exc))
                failures += 1
                await self._pause(failures)
                continue
            finally:
                self._waiting = False
            if await self._take(updates if isinstance(updates, list) else []):
                self._report(None)
                failures = 0
            else:
                failures += 1
                await self._pause(failures)

    async def _take(self, updates: list[Any]) -> bool:
        """Hand the updates over in order, moving the offset past each one taken; False when
        the gateway could not store one (the offset stays on it)."""
        for update in updates:
            update_id = update.get("update_id") if isinstance(update, dict) else None
            if not isinstance(update_id, int) or isinstance(update_id, bool):
                logger.warning("skipped a Telegram update without an update_id")
                continue
            try:
                event = self._read(update)
            except MalformedEventError as exc:
                logger.warning("ignored Telegram update %s, which cannot be read: %s",
                               update_id, exc)  # fmt: skip
                event = None
            if event is not None:
                if self._inbox is None:
                    return True  # stopped: the update stays unconfirmed
                try:
                    await self._inbox.handle_message(event)
                except MessageNotStoredError:  # the gateway logged why
                    self._report(f"update {update_id} not stored; fetching it again")
                    return False
                crash_point("connector_before_ack")
                self._answer_button(update)
            self._offset = max(self._offset or 0, update_id + 1)
        return True

    async def _pause(self, failures: int) -> None:
        cap = self.settings.retry_max_secs
        self._waiting = True
        try:
            await asyncio.sleep(min(cap, FIRST_PAUSE_SECS * 2 ** min(failures - 1, 16)))
        finally:
            self._waiting = False

    def _report(self, problem: str | None) -> None:
        """Log a polling problem once (and its end), and show it in ``status``."""
        if problem != self._problem:
            if problem is not None:
                logger.error("telegram: %s", problem)
            elif self._problem is not None:
                logger.info("telegram: polling works again")
        self._problem = problem


def _poll_problem(exc: BotApiError | httpx.HTTPError) -> str:
    """One line saying why a ``getUpdates`` failed and what fixes it."""
    if isinstance(exc, httpx.HTTPError):
        return f"the Bot API cannot be reached ({type(exc).__name__}); trying again"
    if exc.status == 409:
        return (f"another poller or a webhook takes this bot's updates ({exc.description}); "
                "stop the other instance or delete the webhook")  # fmt: skip
    if exc.status in (401, 404):
        return f"Telegram refuses the bot token ({exc.description}); fix it and restart"
    return f"getUpdates failed ({exc}); trying again"


def build_telegram(context: ConnectorContext) -> TelegramConnector:
    """The connector of ``platforms.telegram``; a ``ConfigError`` for a missing token, or a
    missing or unusable webhook secret in webhook mode."""
    settings = context.settings_as(TelegramSettings)
    token = context.secret(settings.token_env, "token_env")
    secret = None
    if settings.mode == "webhook":
        secret = context.secret(settings.webhook_secret_env, "webhook_secret_env")
        if not re.fullmatch(SECRET_CHARS, secret):
            where = "platforms.telegram.webhook_secret_env"
            raise ConfigError(
                where, f"the secret token in {settings.webhook_secret_env} must be 1 to 256 "
                "letters, digits, _ or - (what Telegram accepts); set it to such a value.",
                source=context.config.source,
            )  # fmt: skip
    public_url = context.config.server.public_url
    return TelegramConnector(settings, token, context.read_event, secret=secret,
                             public_url=public_url, source=context.config.source)  # fmt: skip
