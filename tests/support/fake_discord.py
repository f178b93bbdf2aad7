"""A fake Discord for the connector tests: a gateway websocket (``websockets`` on 127.0.0.1, in
a thread of its own) and the REST API (a Starlette app for
:class:`~support.loopback.LoopbackServer`), sharing one guild's channels and their history.

The gateway speaks HELLO, IDENTIFY (READY and GUILD_CREATE), heartbeats and their ACKs, RESUME
(replaying what was dispatched after the given sequence number, then RESUMED), and on demand
drops the connection, stops acknowledging heartbeats, sends RECONNECT or INVALID_SESSION, or
closes an IDENTIFY with a code. The REST side serves ``/gateway/bot``, channels, their messages
(``after``, newest first as Discord answers), posts, edits, typing and interaction callbacks,
answers from a script of 429s (per route or global), and keeps a message bucket per channel
whose overrun is counted in ``violations``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from support.loopback import LoopbackServer

TOKEN = "fake.discord.bot-token"
GUILD, CHANNEL, THREAD, DM = "900000000000000001", "900000000000000010", "900000000000000020", (
    "900000000000000030")  # fmt: skip
BOT = {"id": "900000000000000099", "username": "hermes", "bot": True}
USER = {"id": "900000000000000050", "username": "ana", "global_name": "Ana"}
CHANNELS: dict[str, dict[str, Any]] = {
    CHANNEL: {"id": CHANNEL, "type": 0, "name": "general", "guild_id": GUILD},
    THREAD: {"id": THREAD, "type": 11, "name": "a thread", "parent_id": CHANNEL,
             "guild_id": GUILD},
    DM: {"id": DM, "type": 1},
}  # fmt: skip


@dataclass(frozen=True)
class Posted:
    """A message the bot posted: channel, content, the message it replies to, mentions."""

    channel: str
    content: str
    reply_to: str | None
    allowed_mentions: Any
    id: str


@dataclass(frozen=True)
class Limit:
    """A scripted 429: wait ``retry_after`` seconds, for every route when ``global_``."""

    retry_after: float
    global_: bool = False


@dataclass
class _Session:
    id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    valid: bool = True


@dataclass
class FakeDiscord:
    """The fake's state; ``app`` is the REST API (under ``/api/v10``), :func:`running` serves
    both sides."""

    heartbeat_ms: int = 41250
    ack: bool = True
    identify_close: int | None = None
    bucket_size: int = 50
    bucket_window: float = 1.0
    ws_url: str = ""
    posted: list[Posted] = field(default_factory=list)
    edits: list[tuple[str, str, str]] = field(default_factory=list)
    typing: list[str] = field(default_factory=list)
    callbacks: list[tuple[str, Any]] = field(default_factory=list)
    identifies: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: int = 0
    violations: int = 0
    calls: list[tuple[str, float]] = field(default_factory=list)
    """Every REST call: (method and path, monotonic time)."""
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    script: list[Limit] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1_300_000_000_000_000_000,
                                                                         1 << 22))  # fmt: skip
    _session: _Session | None = None
    _live: tuple[ServerConnection, asyncio.Queue[dict[str, Any]]] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _window: dict[str, tuple[float, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- what a test does -------------------------------------------------------------------

    def say(self, text: str, channel: str = CHANNEL, *, dispatch: bool = True) -> str:
        """A user's message in ``channel`` (kept in its history; dispatched unless the test
        says it arrived while nobody listened); its id."""
        message = self._message(channel, text, USER)
        if dispatch:
            self.dispatch("MESSAGE_CREATE", self._created(message))
        return str(message["id"])

    def dispatch(self, name: str, data: Any) -> None:
        """Dispatch an event in the current session (sent now if connected, else replayed on
        RESUME)."""
        with self._lock:
            session = self._session
            if session is None:
                return
            frame = {"op": 0, "t": name, "s": len(session.events) + 1, "d": data}
            session.events.append(frame)
        self._send(frame)

    def drop(self) -> None:
        """Cut the connection without a close frame."""
        live, self._live = self._live, None
        if live is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(live[0].transport.abort)

    def close(self, code: int) -> None:
        """Close the connection with ``code`` (4000: resume; 4009: the session timed out)."""
        live, self._live = self._live, None
        if live is not None and self._loop is not None:
            asyncio.run_coroutine_threadsafe(live[0].close(code), self._loop)

    def reconnect(self) -> None:
        """Ask the client to reconnect (op 7)."""
        self._send({"op": 7, "d": None})

    def invalidate(self, resumable: bool) -> None:
        """INVALID_SESSION (op 9); a session that cannot be resumed is forgotten."""
        if not resumable and self._session is not None:
            self._session.valid = False
        self._send({"op": 9, "d": resumable})

    def limit_next(self, *limits: Limit) -> None:
        """Answer the next message posts with these 429s, in order."""
        with self._lock:
            self.script.extend(limits)

    @property
    def texts(self) -> list[str]:
        return [message.content for message in self.posted]

    def answers_to(self, message_id: str) -> list[Posted]:
        return [message for message in self.posted if message.reply_to == message_id]

    # -- the gateway ------------------------------------------------------------------------

    def _send(self, frame: dict[str, Any]) -> None:
        live = self._live
        if live is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(live[1].put_nowait, frame)

    async def _connection(self, ws: ServerConnection) -> None:
        out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def write() -> None:
            while True:
                await ws.send(json.dumps(await out.get()))

        writer = asyncio.create_task(write())
        out.put_nowait({"op": 10, "d": {"heartbeat_interval": self.heartbeat_ms}})
        try:
            async for raw in ws:
                frame = json.loads(raw)
                if frame["op"] == 1:
                    self.heartbeats += 1
                    if self.ack:
                        out.put_nowait({"op": 11})
                elif frame["op"] == 2:
                    await self._identify(ws, out, frame["d"])
                elif frame["op"] == 6:
                    self._resume(ws, out, frame["d"])
        except ConnectionClosed:  # dropped
            pass
        finally:
            writer.cancel()
            if self._live is not None and self._live[0] is ws:
                self._live = None

    async def _identify(
        self, ws: ServerConnection, out: asyncio.Queue[dict[str, Any]], data: dict[str, Any]
    ) -> None:
        self.identifies.append(data)
        if data.get("token") != TOKEN or self.identify_close is not None:
            await ws.close(self.identify_close or 4004, "refused")
            return
        session = _Session(f"session-{len(self.identifies)}")
        with self._lock:
            self._session, self._live = session, (ws, out)
        self.dispatch("READY", {
            "v": 10, "user": BOT, "guilds": [{"id": GUILD, "unavailable": True}],
            "session_id": session.id, "resume_gateway_url": self.ws_url,
        })  # fmt: skip
        guild = [CHANNELS[CHANNEL]]
        self.dispatch("GUILD_CREATE", {"id": GUILD, "name": "Fake Guild", "channels": guild,
                                       "threads": [CHANNELS[THREAD]]})  # fmt: skip

    def _resume(
        self, ws: ServerConnection, out: asyncio.Queue[dict[str, Any]], data: dict[str, Any]
    ) -> None:
        self.resumes.append(data)
        session = self._session
        if data.get("token") != TOKEN or session is None or not session.valid or (
            session.id != data.get("session_id")):  # fmt: skip
            out.put_nowait({"op": 9, "d": False})
            return
        with self._lock:
            for frame in session.events[int(data.get("seq") or 0) :]:
                out.put_nowait(frame)
            self._live = (ws, out)
        self.dispatch("RESUMED", {})  # after the replay: the queue keeps the order

    # -- REST -------------------------------------------------------------------------------

    @property
    def app(self) -> Starlette:
        base = "/api/v10"
        return Starlette(routes=[
            Route(f"{base}/gateway/bot", self._gateway_bot),
            Route(f"{base}/channels/{{channel}}", self._channel),
            Route(f"{base}/channels/{{channel}}/messages", self._messages,
                  methods=["GET", "POST"]),
            Route(f"{base}/channels/{{channel}}/messages/{{message}}", self._edit,
                  methods=["PATCH"]),
            Route(f"{base}/channels/{{channel}}/typing", self._typing, methods=["POST"]),
            Route(f"{base}/interactions/{{id}}/{{token}}/callback", self._callback,
                  methods=["POST"]),
        ])  # fmt: skip

    def _refused(self, request: Request) -> Response | None:
        self.calls.append((f"{request.method} {request.url.path}", time.monotonic()))
        if request.headers.get("authorization") != f"Bot {TOKEN}":
            return JSONResponse({"message": "401: Unauthorized", "code": 0}, 401)
        channel = request.path_params.get("channel")
        if channel is not None and channel not in CHANNELS:
            return JSONResponse({"message": "Unknown Channel", "code": 10003}, 404)
        return None

    async def _gateway_bot(self, request: Request) -> Response:
        return self._refused(request) or JSONResponse({"url": self.ws_url, "shards": 1})

    async def _channel(self, request: Request) -> Response:
        return self._refused(request) or JSONResponse(CHANNELS[request.path_params["channel"]])

    async def _messages(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        channel = request.path_params["channel"]
        if request.method == "GET":
            after = int(request.query_params.get("after", "0"))
            limit = int(request.query_params.get("limit", "50"))
            found = [m for m in self.history.get(channel, []) if int(m["id"]) > after][:limit]
            return JSONResponse(found[::-1])
        limited = self._limited(channel)
        if limited is not None:
            return limited
        body = await request.json()
        content = body.get("content") or ""
        if not content or len(content) > 2000:
            return JSONResponse({"message": "Invalid Form Body", "code": 50035}, 400)
        reference = body.get("message_reference") or {}
        message = self._message(channel, content, BOT)
        self.posted.append(Posted(channel, content, reference.get("message_id"),
                                  body.get("allowed_mentions"), str(message["id"])))  # fmt: skip
        self.dispatch("MESSAGE_CREATE", self._created(message))
        return JSONResponse(message, headers=self._bucket_headers(channel))

    def _limited(self, channel: str) -> Response | None:
        """A scripted 429, or one for overrunning the channel's bucket."""
        with self._lock:
            limit = self.script.pop(0) if self.script else None
            now = time.monotonic()
            start, used = self._window.get(channel, (now, 0))
            if now - start >= self.bucket_window:
                start, used = now, 0
            if limit is None and used >= self.bucket_size:
                self.violations += 1
                limit = Limit(self.bucket_window - (now - start))
            if limit is None:
                self._window[channel] = (start, used + 1)
                return None
        headers = {"Retry-After": str(max(1, round(limit.retry_after)))}
        if limit.global_:
            headers["X-RateLimit-Global"] = "true"
        body = {"message": "You are being rate limited.", "retry_after": limit.retry_after,
                "global": limit.global_}  # fmt: skip
        return JSONResponse(body, 429, headers=headers)

    def _bucket_headers(self, channel: str) -> dict[str, str]:
        start, used = self._window[channel]
        reset = max(0.0, start + self.bucket_window - time.monotonic())
        return {
            "X-RateLimit-Bucket": "fake-messages", "X-RateLimit-Limit": str(self.bucket_size),
            "X-RateLimit-Remaining": str(max(0, self.bucket_size - used)),
            "X-RateLimit-Reset-After": f"{reset:.3f}",
        }  # fmt: skip

    async def _edit(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        channel, wanted = request.path_params["channel"], request.path_params["message"]
        content = (await request.json()).get("content")
        for message in self.history.get(channel, []):
            if message["id"] == wanted and message["author"] is BOT:
                message["content"] = content
                self.edits.append((channel, wanted, content))
                return JSONResponse(message)
        return JSONResponse({"message": "Unknown Message", "code": 10008}, 404)

    async def _typing(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        self.typing.append(request.path_params["channel"])
        return Response(status_code=204)

    async def _callback(self, request: Request) -> Response:
        self.callbacks.append((request.path_params["id"], await request.json()))
        return Response(status_code=204)

    # -- messages ---------------------------------------------------------------------------

    def _message(self, channel: str, text: str, author: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            message = {"id": str(next(self._ids)), "channel_id": channel, "author": author,
                       "content": text, "type": 0}  # fmt: skip
            self.history.setdefault(channel, []).append(message)
        return message

    @staticmethod
    def _created(message: dict[str, Any]) -> dict[str, Any]:
        """A history message as MESSAGE_CREATE carries it (with its guild)."""
        guild = CHANNELS[message["channel_id"]].get("guild_id")
        return {**message, "guild_id": guild} if guild else dict(message)


@contextlib.contextmanager
def running(fake: FakeDiscord | None = None) -> Iterator[tuple[FakeDiscord, str]]:
    """The fake's gateway and REST API on 127.0.0.1: (the fake, the REST base URL)."""
    fake = fake or FakeDiscord()
    started = threading.Event()
    stopping: list[asyncio.Future[None]] = []

    async def main() -> None:
        fake._loop = asyncio.get_running_loop()
        async with serve(fake._connection, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            fake.ws_url = f"ws://127.0.0.1:{port}"
            stopping.append(fake._loop.create_future())
            started.set()
            await stopping[0]

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10), "the fake gateway did not start"
    try:
        with LoopbackServer(fake.app) as server:
            yield fake, f"{server.url}/api/v10"
    finally:
        assert fake._loop is not None
        fake._loop.call_soon_threadsafe(stopping[0].set_result, None)
        thread.join(10)
