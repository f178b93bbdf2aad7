"""The Discord connector: events arrive over the gateway websocket
(:mod:`~hermes_plugins.connectors.discord_gateway`), replies leave over REST
(:class:`~hermes_plugins.connectors.discord_rest.DiscordAdapter`).

``MESSAGE_CREATE`` and ``INTERACTION_CREATE`` are read by :mod:`hermes_plugins.readers.discord`
with a channel cache this connector fills from ``GUILD_CREATE`` (channels and threads) and the
channel and thread events, so that a thread is keyed under its parent channel. Dispatches are
handed over one at a time, in the order they arrived.

Discord does not deliver an event twice, so durability after a restart comes from reading back:
per channel, the id of the last message handed over is kept (:mod:`.discord_state`), and after
each new session (READY) every known channel's messages after it are read over REST (oldest
first, a page of 100 at a time) and handed over like dispatches; the gateway's redelivery
records answer each message once. A message the gateway could not store puts its channel
behind: its id stops moving and it is read back after a pause until everything is stored. An
interaction is acknowledged (a deferred response) only once stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hermes_core.domain.connectors import ConnectorContext, Inbox, WebhookRoute
from hermes_core.domain.errors import ConfigError, MalformedEventError, MessageNotStoredError
from hermes_core.domain.models import MessageEvent
from hermes_core.domain.specs import ReadContext
from hermes_core.turns.crashpoints import crash_point
from hermes_plugins.connectors.discord_gateway import DiscordGateway, GatewayRefusedError
from hermes_plugins.connectors.discord_rest import DiscordAdapter, DiscordRest, RateLimitedError
from hermes_plugins.connectors.discord_state import LastSeen

__all__ = ["DEFAULT_INTENTS", "INTENTS", "DiscordConnector", "DiscordSettings", "build"]

logger = logging.getLogger(__name__)

INTENTS = {
    "GUILDS": 1 << 0, "GUILD_MEMBERS": 1 << 1, "GUILD_MODERATION": 1 << 2,
    "GUILD_EXPRESSIONS": 1 << 3, "GUILD_INTEGRATIONS": 1 << 4, "GUILD_WEBHOOKS": 1 << 5,
    "GUILD_INVITES": 1 << 6, "GUILD_VOICE_STATES": 1 << 7, "GUILD_PRESENCES": 1 << 8,
    "GUILD_MESSAGES": 1 << 9, "GUILD_MESSAGE_REACTIONS": 1 << 10,
    "GUILD_MESSAGE_TYPING": 1 << 11, "DIRECT_MESSAGES": 1 << 12,
    "DIRECT_MESSAGE_REACTIONS": 1 << 13, "DIRECT_MESSAGE_TYPING": 1 << 14,
    "MESSAGE_CONTENT": 1 << 15, "GUILD_SCHEDULED_EVENTS": 1 << 16,
    "AUTO_MODERATION_CONFIGURATION": 1 << 20, "AUTO_MODERATION_EXECUTION": 1 << 21,
    "GUILD_MESSAGE_POLLS": 1 << 24, "DIRECT_MESSAGE_POLLS": 1 << 25,
}  # fmt: skip
"""The gateway intents by name (Discord's bit values)."""
DEFAULT_INTENTS = ("GUILDS", "GUILD_MESSAGES", "DIRECT_MESSAGES", "MESSAGE_CONTENT")
DEFAULT_GATEWAY = "wss://gateway.discord.gg"
"""Used when ``GET /gateway/bot`` does not answer."""
PAGE = 100
"""Messages per ``GET /channels/{id}/messages`` page (Discord's most)."""
READY_SECS = 30.0
"""How long ``start`` waits for the first session before going on (it keeps trying)."""
BEHIND_PAUSE_SECS = 2.0
"""The pause before a channel that is behind is read back again."""
_DEFERRED = {2: 5, 3: 6, 5: 5}
"""Interaction type → its deferred response: a command or a modal "thinks", a component's
message stays as it is."""
_THREADS = frozenset({10, 11, 12})


class DiscordSettings(BaseModel):
    """``platforms.discord``: what the connector reads (other keys belong to the host)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    token_env: str = Field(
        "DISCORD_BOT_TOKEN", min_length=1,
        description="the name of the environment variable holding the bot token",
    )  # fmt: skip
    intents: list[str] | int = Field(
        list(DEFAULT_INTENTS),
        description="gateway intent names (GUILDS, GUILD_MESSAGES, DIRECT_MESSAGES, "
        "MESSAGE_CONTENT, ...) or their bits as one integer",
    )
    api_base: str = Field(
        "https://discord.com/api/v10", pattern=r"^https?://\S+$",
        description="the REST API's base URL (http(s)://...)",
    )  # fmt: skip
    gateway_url: str | None = Field(
        None, pattern=r"^wss?://\S+$",
        description="the gateway's ws(s):// URL; by default the one GET /gateway/bot names",
    )  # fmt: skip
    state_file: Path | None = Field(
        None, description="where the last message id per channel is kept (a file path); by "
        "default discord/last_seen.json under the Hermes home",
    )  # fmt: skip

    @field_validator("intents")
    @classmethod
    def _known(cls, value: list[str] | int) -> list[str] | int:
        if isinstance(value, int):
            if value < 0:
                raise ValueError("the intents integer must not be negative")
            return value
        unknown = [name for name in value if name.upper() not in INTENTS]
        if unknown:
            raise ValueError(f"unknown intents {unknown}; known: {', '.join(INTENTS)}")
        return value

    def intent_bits(self) -> int:
        """The intents as Discord's bit field."""
        if isinstance(self.intents, int):
            return self.intents
        return sum({INTENTS[name.upper()] for name in self.intents})


Reader = Callable[[Mapping[str, Any], ReadContext], MessageEvent | None]


class DiscordConnector:
    """A Discord bot: the gateway session, read back after restarts; replies through
    ``adapter``."""

    platform = "discord"
    routes: tuple[WebhookRoute, ...] = ()

    def __init__(
        self, settings: DiscordSettings, token: str, read: Reader, state_file: Path,
        *, source: str | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.rest = DiscordRest(settings.api_base, token)
        self.adapter = DiscordAdapter(self.rest)
        self.gateway = DiscordGateway(
            token, settings.intent_bits(), self._gateway_url, self._queue_it
        )
        self.seen = LastSeen(state_file)
        self.channels: dict[str, dict[str, Any]] = {}
        """The channel cache: id → channel object (with ``guild_id``)."""
        self._read = read
        self._context = ReadContext(lookup_chat=self.channels.get)
        self._source = source
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._inbox: Inbox | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._behind: set[str] = set()
        self._reading_back: asyncio.Task[None] | None = None

    async def start(self, inbox: Inbox) -> None:
        """Open the gateway session and begin handing events over; a ``ConfigError`` when
        Discord refuses the token or the intents. A gateway that does not answer in time is a
        warning: the session keeps trying."""
        self._inbox = inbox
        self.adapter.connected = True
        running = asyncio.create_task(self.gateway.run(), name="discord-gateway")
        self._tasks = [running, asyncio.create_task(self._consume(), name="discord-events")]
        ready = asyncio.create_task(self.gateway.ready.wait())
        await asyncio.wait([running, ready], timeout=READY_SECS,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        ready.cancel()
        if running.done():
            exc = running.exception()
            await self.stop()
            if isinstance(exc, GatewayRefusedError):
                key = "token_env" if exc.code == 4004 else "intents"
                raise ConfigError(f"platforms.discord.{key}", f"{exc}; fix platforms.discord."
                                  f"{key} and start again.", source=self._source)  # fmt: skip
            raise exc or RuntimeError("the Discord gateway stopped")
        if not self.gateway.ready.is_set():
            logger.warning("discord: no gateway session after %.0f s; still trying", READY_SECS)

    async def _gateway_url(self) -> str:
        """The configured gateway URL, else the one ``GET /gateway/bot`` names."""
        if self.settings.gateway_url:
            return self.settings.gateway_url
        try:
            response = await self.rest.call("GET", "/gateway/bot")
        except (httpx.HTTPError, RateLimitedError) as exc:
            logger.warning("discord: GET /gateway/bot failed (%s); using %s", exc, DEFAULT_GATEWAY)
            return DEFAULT_GATEWAY
        if response.status_code == 401:
            raise GatewayRefusedError(4004, "GET /gateway/bot answered 401")
        body = response.json() if response.is_success else {}
        return str(body.get("url") or DEFAULT_GATEWAY)

    async def stop(self) -> None:
        """Stop taking events: the event in hand is finished, the rest are read back after
        the next start; the state file is written. Replies can still be sent (a drain's)."""
        self._inbox = None
        tasks, self._tasks = self._tasks, []
        if self._reading_back is not None:
            tasks.append(self._reading_back)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.seen.close()
        await self.rest.close()

    def status(self) -> str:
        user = self.gateway.user.get("username") or "?"
        where = self.settings.gateway_url or "the URL GET /gateway/bot names"
        problem = f" ({self.gateway.problem})" if self.gateway.problem else ""
        return f"discord: gateway {where} as {user}{problem}"

    # -- events -----------------------------------------------------------------------------

    def _queue_it(self, name: str, data: Any) -> None:
        self._queue.put_nowait((name, data))

    async def _consume(self) -> None:
        """Hand the dispatches over in the order they arrived."""
        while True:
            name, data = await self._queue.get()
            try:
                await self._dispatch(name, data)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("discord: ignored a %s dispatch that cannot be read (%r)", name, exc)

    async def _dispatch(self, name: str, data: Any) -> None:
        """Keep the channel cache, read back after a new session, hand messages over."""
        if not isinstance(data, dict):
            return
        if name == "GUILD_CREATE":
            for channel in [*data.get("channels", []), *data.get("threads", [])]:
                self.channels[str(channel["id"])] = {**channel, "guild_id": data.get("id")}
        elif name in ("CHANNEL_CREATE", "CHANNEL_UPDATE", "THREAD_CREATE", "THREAD_UPDATE"):
            self.channels[str(data["id"])] = data
        elif name in ("CHANNEL_DELETE", "THREAD_DELETE"):
            self.channels.pop(str(data.get("id")), None)
        elif name == "READY":  # a new session: what came meanwhile is read back
            self._fall_behind(*self.seen.channels())
        elif name == "MESSAGE_CREATE":
            payload = {"op": 0, "t": name, "d": data}
            await self._take(payload, str(data.get("channel_id")), str(data.get("id")))
        elif name == "INTERACTION_CREATE":
            await self._interaction(data)

    async def _take(
        self, payload: Mapping[str, Any], channel: str, message_id: str, *, back: bool = False
    ) -> bool:
        """Hand one message over; then its channel's id moves past it, unless the channel is
        behind and this is not its reading back. False when it was not stored."""
        self.seen.know(channel, message_id)
        try:
            event = self._read(payload, self._context)
        except MalformedEventError as exc:
            logger.warning("discord: ignored message %s, which cannot be read: %s",
                           message_id, exc)  # fmt: skip
            event = None
        if event is not None:
            if self._inbox is None:
                return False
            try:
                await self._inbox.handle_message(event)
            except MessageNotStoredError:  # the gateway logged why
                self._fall_behind(channel)
                return False
            crash_point("connector_before_ack")
        if back or channel not in self._behind:
            self.seen.advance(channel, message_id)
        return True

    async def _interaction(self, data: dict[str, Any]) -> None:
        """Store an interaction, then acknowledge it with a deferred response."""
        try:
            event = self._read({"op": 0, "t": "INTERACTION_CREATE", "d": data}, self._context)
        except MalformedEventError as exc:
            logger.warning("discord: ignored an interaction that cannot be read: %s", exc)
            return
        if event is None or self._inbox is None:
            return
        try:
            await self._inbox.handle_message(event)
        except MessageNotStoredError:
            return  # not acknowledged: the user sees it failed and can try again
        path = f"/interactions/{data.get('id')}/{data.get('token')}/callback"
        with contextlib.suppress(httpx.HTTPError, RateLimitedError):
            await self.rest.call(
                "POST", path, json={"type": _DEFERRED.get(int(data.get("type") or 0), 5)}
            )

    # -- reading back -----------------------------------------------------------------------

    def _fall_behind(self, *channels: str) -> None:
        """Read these channels back (now, and after pauses until it worked)."""
        self._behind.update(channels)
        if self._behind and (self._reading_back is None or self._reading_back.done()):
            self._reading_back = asyncio.create_task(self._read_back(), name="discord-read-back")

    async def _read_back(self) -> None:
        while self._behind and self._inbox is not None:
            for channel in sorted(self._behind):
                if await self._read_channel(channel):
                    self._behind.discard(channel)
            if self._behind:
                await asyncio.sleep(BEHIND_PAUSE_SECS)

    async def _read_channel(self, channel: str) -> bool:
        """Hand over the channel's messages after its last id, oldest first; True once all
        were, or the channel is gone."""
        info = await self._channel_info(channel)
        if info is None:
            return False
        extra = {"guild_id": info["guild_id"]} if info.get("guild_id") else {}
        if info.get("type") not in _THREADS:
            extra["channel_type"] = info.get("type")
        while True:
            after = self.seen.channels().get(channel, "0")
            params = {"after": after, "limit": PAGE}
            page = await self._get(f"/channels/{channel}/messages", params, forget=channel)
            if page is None:
                return False
            messages = sorted((m for m in page if isinstance(m, dict)), key=lambda m: int(m["id"]))
            for message in messages:
                payload = {"op": 0, "t": "MESSAGE_CREATE", "d": {**message, **extra}}
                if not await self._take(payload, channel, str(message["id"]), back=True):
                    return False
            if len(page) < PAGE:
                return True

    async def _channel_info(self, channel: str) -> dict[str, Any] | None:
        """The cached channel, else ``GET /channels/{id}`` (cached); a channel that is gone is
        forgotten (returns None, and is no longer behind)."""
        if channel not in self.channels:
            found = await self._get(f"/channels/{channel}", None, forget=channel)
            if not isinstance(found, dict):
                return None
            self.channels[channel] = found
        return self.channels[channel]

    async def _get(self, path: str, params: Mapping[str, Any] | None, *,
                   forget: str | None = None) -> Any:  # fmt: skip
        """The JSON of a GET; None when it failed (403/404 forget the channel ``forget``)."""
        try:
            response = await self.rest.call("GET", path, params=params)
        except (httpx.HTTPError, RateLimitedError) as exc:
            logger.warning("discord: GET %s failed (%s); trying again later", path, exc)
            return None
        if response.status_code in (403, 404) and forget is not None:
            logger.warning("discord: channel %s is gone or unreadable; not read back", forget)
            self.seen.forget(forget)
            self._behind.discard(forget)
            return None
        return response.json() if response.is_success else None


def build(context: ConnectorContext) -> DiscordConnector:
    """The connector of ``platforms.discord``; a ``ConfigError`` for a missing token."""
    settings = context.settings_as(DiscordSettings)
    token = context.secret(settings.token_env, "token_env")
    state = settings.state_file or context.config.hermes_home / "discord" / "last_seen.json"
    read: Reader = context.read_in_context or (lambda payload, _: context.read_event(payload))
    return DiscordConnector(settings, token, read, state, source=context.config.source)
