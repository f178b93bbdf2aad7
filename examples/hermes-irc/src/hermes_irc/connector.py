"""The IRC connector: one client connection (plain asyncio streams, TLS optional) that joins the
configured channels, hands channel messages and private messages to the gateway, and sends the
gateway's replies as PRIVMSG lines.

Acknowledgement: IRC has none, and no message ids — a server sends each line once and never
again, so the rule "acknowledge only what is stored" cannot hold here. What the connector keeps:
a message is stored (``Inbox.handle_message`` returned) before the next line is read. A message
the gateway cannot store is lost to IRC; the sender is told so with a NOTICE. A message that
arrives while the connection is down is never seen.

The connection is re-established with a doubling pause when it drops; the channels are joined
again and the gateway is told (``Inbox.platform_connected``) so that replies owed meanwhile go
out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from hermes_core import (
    ConfigError,
    ConnectorContext,
    Inbox,
    MessageEvent,
    MessageNotStoredError,
    SendResult,
    SessionSource,
    WebhookRoute,
)
from hermes_irc import irc_casefold
from hermes_irc.lines import CHANNEL_PREFIXES, Line, parse_line, privmsg_lines

__all__ = ["IrcAdapter", "IrcConnector", "IrcSettings", "build_irc"]

logger = logging.getLogger(__name__)

PLATFORM = "irc"
REGISTER_SECS = 30.0
"""How long the server may take to welcome the client (numeric 001)."""
FIRST_PAUSE_SECS = 1.0
"""The first pause before reconnecting; it doubles up to ``retry_max_secs``."""
REFUSALS = {"432": "nick", "464": "password_env", "465": "server"}
"""Numerics refusing the registration, by the setting to fix: an unusable nickname, a wrong
server password, a ban."""
NOT_STORED = "your message was not stored (the bot's store is unavailable); please send it again"

Channel = Annotated[str, StringConstraints(pattern=r"^[#&+!][^\s,\x07]{1,49}$")]


class IrcSettings(BaseModel):
    """``platforms.irc``: what the connector reads (other keys belong to the host)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    server: str = Field(
        min_length=1, pattern=r"^[^\s:/]+$", description="the IRC server's host name"
    )
    port: int = Field(6667, ge=1, le=65535, description="a TCP port from 1 to 65535")
    tls: bool = Field(False, description="true (TLS, certificates checked) or false")
    nick: str = Field(
        pattern=r"^[A-Za-z\[\]\\`_^{|}][A-Za-z0-9\[\]\\`_^{|}-]{0,29}$",
        description="a nickname: a letter or one of []\\`_^{|} then letters, digits or -",
    )
    channels: tuple[Channel, ...] = Field(
        (), description="a list of channel names starting with # or &, e.g. ['#hermes']"
    )
    network: str = Field(
        min_length=1, pattern=r"^\S+$",
        description="the network's name, e.g. libera (the sessions' scope)",
    )  # fmt: skip
    password_env: str | None = Field(
        None, min_length=1,
        description="the name of the environment variable holding the server password, or null",
    )  # fmt: skip
    retry_max_secs: float = Field(
        60.0, gt=0, le=600, description="seconds from 0 to 600 (the longest pause to reconnect)"
    )
    line_delay_secs: float = Field(
        0.5, ge=0, le=10,
        description="seconds from 0 to 10 between the lines of one reply (servers cut floods)",
    )  # fmt: skip


class IrcRefusedError(Exception):
    """The server refused the registration (a numeric of :data:`REFUSALS`)."""

    def __init__(self, numeric: str, reason: str) -> None:
        super().__init__(f"{numeric} {reason}")
        self.numeric = numeric


class IrcAdapter:
    """Sends replies as PRIVMSG lines on the connector's current connection."""

    platform = PLATFORM

    def __init__(self, line_delay_secs: float) -> None:
        self.writer: asyncio.StreamWriter | None = None
        """The registered connection's writer; None while there is none."""
        self._delay = line_delay_secs
        self._lock = asyncio.Lock()
        """One reply's lines go out together, not interleaved with another reply's."""

    def is_connected(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        """Send ``text`` to the channel (or the nickname) of ``source``. Written is all IRC
        can tell: a line lost with the connection is not reported."""
        return await self.write(privmsg_lines(source.chat_id, text))

    async def write(self, lines: list[str]) -> SendResult:
        """Write ``lines`` in order; ``disconnected`` when there is no connection."""
        async with self._lock:
            for index, line in enumerate(lines):
                writer = self.writer
                if writer is None or writer.is_closing():
                    return SendResult(ok=False, failure_kind="disconnected",
                                      error="not connected to the IRC server")  # fmt: skip
                if index and self._delay:
                    await asyncio.sleep(self._delay)
                try:
                    writer.write(line.encode("utf-8") + b"\r\n")
                    await writer.drain()
                except OSError as exc:
                    return SendResult(ok=False, failure_kind="disconnected", error=str(exc))
        return SendResult(ok=True)


class IrcConnector:
    """An IRC client: a task that connects, reads lines and reconnects; replies via ``adapter``."""

    platform = PLATFORM
    routes: tuple[WebhookRoute, ...] = ()

    def __init__(
        self, settings: IrcSettings, password: str | None, *, source: str | None = None
    ) -> None:
        self.settings = settings
        self.adapter = IrcAdapter(settings.line_delay_secs)
        self.nick = settings.nick
        """The nickname in use (``_`` is appended while the configured one is taken)."""
        self._password = password
        self._source = source
        self._inbox: Inbox | None = None
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        """The task works with the gateway (stores a message): stopping waits for it there and
        cancels it anywhere else."""
        self._first: asyncio.Future[None] | None = None
        """Settled by the first connection attempt, which ``start`` waits for."""
        self._problem: str | None = None

    async def start(self, inbox: Inbox) -> None:
        """Connect, register and join; returns after the first attempt. A refused registration
        is a ``ConfigError``; a server that cannot be reached a warning (the task keeps
        trying, sends fail as ``disconnected`` meanwhile)."""
        self._inbox = inbox
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="irc-client")
        await asyncio.wait({self._first, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not self._first.done():
            self._task.result()  # the task ended before settling: its error
        self._first.result()

    async def stop(self) -> None:
        """Stop taking messages (one being stored is stored first), say QUIT and close."""
        self._inbox = None
        task, self._task = self._task, None
        writer = self.adapter.writer
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(OSError):
                writer.write(b"QUIT :shutting down\r\n")
                await writer.drain()
        if task is not None:
            if not self._busy:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def status(self) -> str:
        s = self.settings
        where = ", ".join(s.channels) or "no channel"
        problem = f" ({self._problem})" if self._problem else ""
        return f"irc: {s.server}:{s.port} as {self.nick} in {where}{problem}"

    # -- the connection ---------------------------------------------------------------------

    async def _run(self) -> None:
        """Connect, read until the connection drops, pause, connect again, until stopped."""
        failures, connections = 0, 0
        while self._inbox is not None:
            try:
                reader, writer = await self._connect()
            except (OSError, asyncio.TimeoutError, IrcRefusedError) as exc:
                if not self._settle_first(exc):
                    return
                failures += 1
                self._report(f"cannot connect ({exc or type(exc).__name__}); trying again")
                await self._pause(failures)
                continue
            failures, connections = 0, connections + 1
            self.adapter.writer = writer
            self._report(None)
            self._settle_first(None)
            lost = "the server closed the connection"
            try:
                if connections > 1:
                    await self._reconnected()
                await self._read(reader)
            except OSError as exc:
                lost = f"the connection was lost ({exc})"
            finally:
                self.adapter.writer = None
                writer.close()
            if self._inbox is not None:
                self._report(f"{lost}; reconnecting")
                await self._pause(1)

    async def _reconnected(self) -> None:
        """Tell the gateway the link is back: the replies owed meanwhile go out."""
        inbox = self._inbox
        if inbox is not None:
            self._busy = True
            try:
                await inbox.platform_connected(PLATFORM)
            finally:
                self._busy = False

    def _settle_first(self, exc: BaseException | None) -> bool:
        """Settle ``start``'s wait; False when ``exc`` is a refusal to report there (the task
        ends: the configuration must change)."""
        first = self._first
        if first is None or first.done():
            return True
        if isinstance(exc, IrcRefusedError):
            key = f"platforms.irc.{REFUSALS[exc.numeric]}"
            first.set_exception(ConfigError(
                key, f"the IRC server {self.settings.server} refused the connection ({exc}); "
                f"fix {key}.", source=self._source,
            ))  # fmt: skip
            return False
        first.set_result(None)  # unreachable: _run logs it and keeps trying
        return True

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open the connection, register (PASS, NICK, USER), wait for the welcome, JOIN."""
        s = self.settings
        context = ssl.create_default_context() if s.tls else None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(s.server, s.port, ssl=context), REGISTER_SECS
        )
        self.nick = s.nick
        try:
            await asyncio.wait_for(self._register(reader, writer), REGISTER_SECS)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _register(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = [f"PASS :{self._password}"] if self._password else []
        hello += [f"NICK {self.nick}", f"USER {self.settings.nick} 0 * :hermes-sessions"]
        await _send(writer, hello)
        while True:
            line = await _next_line(reader)
            if line is None:
                raise ConnectionResetError("the server closed the connection while registering")
            if line.command == "PING":
                await _send(writer, [f"PONG :{line.params[-1] if line.params else ''}"])
            elif line.command == "001":
                break
            elif line.command == "433":  # nickname in use: try another
                self.nick += "_"
                await _send(writer, [f"NICK {self.nick}"])
            elif line.command in REFUSALS:
                raise IrcRefusedError(line.command, line.params[-1] if line.params else "")
            elif line.command == "ERROR":  # e.g. throttled: a later attempt may pass
                raise ConnectionResetError(line.params[-1] if line.params else "ERROR")
        if self.settings.channels:
            await _send(writer, [f"JOIN {','.join(self.settings.channels)}"])

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Read lines until the connection closes or the connector stops."""
        while self._inbox is not None:
            line = await _next_line(reader)
            if line is None:
                return
            if line.command == "PING":
                token = line.params[-1] if line.params else ""
                await self.adapter.write([f"PONG :{token}"])
            elif line.command == "PRIVMSG" and len(line.params) == 2:
                await self._take(line)

    async def _take(self, line: Line) -> None:
        """Hand a PRIVMSG to the gateway (CTCP requests and our own lines aside)."""
        target, text = line.params
        sender = line.nick
        inbox = self._inbox
        ours = irc_casefold(sender) == irc_casefold(self.nick)
        if inbox is None or not text or text.startswith("\x01") or ours:
            return
        group = target[:1] in CHANNEL_PREFIXES
        source = SessionSource(
            platform=PLATFORM, chat_id=target if group else sender,
            chat_type="group" if group else "dm", user_id=sender, user_name=sender,
            scope_id=self.settings.network,
        )  # fmt: skip
        self._busy = True
        try:
            await inbox.handle_message(MessageEvent(source=source, text=text))
        except MessageNotStoredError:  # the gateway logged why
            logger.error("irc: a message from %s in %s was not stored; IRC will not deliver "
                         "it again, so %s is told", sender, source.chat_id, sender)  # fmt: skip
            await self.adapter.write(privmsg_lines(sender, NOT_STORED, "NOTICE"))
        finally:
            self._busy = False

    async def _pause(self, failures: int) -> None:
        cap = self.settings.retry_max_secs
        await asyncio.sleep(min(cap, FIRST_PAUSE_SECS * 2 ** min(failures - 1, 16)))

    def _report(self, problem: str | None) -> None:
        """Log a connection problem once (and its end), and show it in ``status``."""
        if problem != self._problem:
            if problem is not None:
                logger.error("irc: %s", problem)
            elif self._problem is not None:
                logger.info("irc: connected again")
        self._problem = problem


async def _send(writer: asyncio.StreamWriter, lines: list[str]) -> None:
    writer.write(b"".join(line.encode("utf-8") + b"\r\n" for line in lines))
    await writer.drain()


async def _next_line(reader: asyncio.StreamReader) -> Line | None:
    """The next non-blank line; None at the end of the connection."""
    while True:
        raw = await reader.readline()
        if not raw:
            return None
        line = parse_line(raw.decode("utf-8", errors="replace"))
        if line is not None:
            return line


def build_irc(context: ConnectorContext) -> IrcConnector:
    """The connector of ``platforms.irc``; a ``ConfigError`` naming the key for a bad setting
    or an unset password variable."""
    settings = context.settings_as(IrcSettings)
    password = None
    if settings.password_env:
        password = context.secret(settings.password_env, "password_env")
    return IrcConnector(settings, password, source=context.config.source)
