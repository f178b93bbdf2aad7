"""Discord's gateway websocket as Discord documents it: HELLO (op 10), then heartbeats (op 1)
every ``heartbeat_interval`` (the first after a random part of it) and their acknowledgements
(op 11), IDENTIFY (op 2) with the intents for a new session or RESUME (op 6) with the session id
and the last sequence number ``s`` to the session's ``resume_gateway_url``.

A connection that drops, or whose heartbeat went unacknowledged (a zombie: closed here), or
that Discord asks to leave (RECONNECT, op 7), is resumed: Discord replays what was dispatched
meanwhile. INVALID_SESSION (op 9) says whether the session can be resumed (``d`` true) or a new
one must be identified after one to five seconds (``d`` false); so do the close codes 4007 and
4009. The close codes that no reconnecting can cure (4004 a refused token, 4010-4012, 4013 and
4014 intents) end :meth:`DiscordGateway.run` with :class:`GatewayRefusedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

__all__ = ["FATAL_CLOSE_CODES", "DiscordGateway", "GatewayRefusedError"]

logger = logging.getLogger(__name__)

QUERY = "?v=10&encoding=json"
HELLO_SECS = 20.0
"""How long a new connection waits for HELLO."""
CLOSE_SECS = 2.0
"""How long closing waits for the other side's close frame (a zombie sends none)."""
RESUMING_CLOSE = 4900
"""The code this side closes with when it will resume (1000 and 1001 end the session)."""
FATAL_CLOSE_CODES = {
    4004: "Discord refused the bot token (4004 authentication failed)",
    4010: "Discord refused the shard (4010 invalid shard)",
    4011: "Discord requires sharding for this bot (4011 sharding required)",
    4012: "Discord refused the API version (4012 invalid API version)",
    4013: "Discord refused the intents (4013 invalid intents)",
    4014: "Discord refused a privileged intent the bot is not allowed "
    "(4014 disallowed intents; enable it in the Developer Portal's Bot page)",
}
"""Close codes after which reconnecting cannot help: the configuration must change."""
NEW_SESSION_CODES = frozenset({4007, 4009})
"""Invalid sequence, session timed out: reconnect with a new session."""
FIRST_PAUSE_SECS = 1.0
MAX_PAUSE_SECS = 60.0


class GatewayRefusedError(Exception):
    """Discord closed the gateway with a code that forbids reconnecting."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(FATAL_CLOSE_CODES.get(code, f"closed with {code}") + (
            f": {reason}" if reason else ""))  # fmt: skip
        self.code = code


class _Reconnect(Exception):
    """Leave this connection and open another (resuming when there is a session)."""


class DiscordGateway:
    """One bot's gateway session across connections; hands each dispatch (its name and ``d``)
    to ``dispatch``, which must not block (queue it)."""

    def __init__(
        self,
        token: str,
        intents: int,
        gateway_url: Callable[[], Awaitable[str]],
        dispatch: Callable[[str, Any], None],
    ) -> None:
        self._token = token
        self._intents = intents
        self._gateway_url = gateway_url
        self._dispatch = dispatch
        self.session_id: str | None = None
        self.resume_url: str | None = None
        self.seq: int | None = None
        self.ready = asyncio.Event()
        """Set by READY and RESUMED, cleared when a connection ends."""
        self.user: dict[str, Any] = {}
        self.problem: str | None = None
        self._acked = True
        self._new_session_pause = 0.0

    async def run(self) -> None:
        """Connect, and again after every connection ends, until cancelled or refused
        (:class:`GatewayRefusedError`)."""
        failures = 0
        while True:
            try:
                await self._connection()
            except _Reconnect:
                failures = 0
                continue
            except (ConnectionClosed, InvalidHandshake, InvalidURI, OSError, TimeoutError) as exc:
                self._report(f"the gateway connection failed ({type(exc).__name__}); reconnecting")
            finally:
                self.ready.clear()
            failures += 1
            await asyncio.sleep(min(MAX_PAUSE_SECS, FIRST_PAUSE_SECS * 2 ** min(failures - 1, 8)))

    async def _connection(self) -> None:
        """One connection: HELLO, IDENTIFY or RESUME, then frames until it ends."""
        if self._new_session_pause:
            await asyncio.sleep(self._new_session_pause)
            self._new_session_pause = 0.0
        resuming = self.session_id is not None and self.resume_url is not None
        url = self.resume_url if resuming and self.resume_url else await self._gateway_url()
        async with connect(
            url.rstrip("/") + "/" + QUERY, max_size=2**24, close_timeout=CLOSE_SECS
        ) as ws:
            hello = json.loads(await asyncio.wait_for(ws.recv(), HELLO_SECS))
            if hello.get("op") != 10:
                raise _Reconnect
            interval = float(hello["d"]["heartbeat_interval"]) / 1000
            self._acked = True
            beating = asyncio.create_task(self._heartbeat(ws, interval), name="discord-heartbeat")
            try:
                await ws.send(json.dumps(self._resume() if resuming else self._identify()))
                async for raw in ws:
                    await self._frame(ws, json.loads(raw))
            except ConnectionClosed:
                pass
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
            self._closed(ws)

    def _closed(self, ws: ClientConnection) -> None:
        """What the close code says: refused for good, a new session, or resume."""
        code = ws.close_code or 1006
        reason = ws.close_reason or ""
        if code in FATAL_CLOSE_CODES:
            self.problem = str(GatewayRefusedError(code, reason))
            raise GatewayRefusedError(code, reason)
        if code in NEW_SESSION_CODES:
            self.session_id = None
        if code == RESUMING_CLOSE:
            raise _Reconnect
        raise ConnectionError(f"closed with {code}")

    async def _frame(self, ws: ClientConnection, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        if op == 0:
            if isinstance(frame.get("s"), int):
                self.seq = frame["s"]
            name, data = str(frame.get("t")), frame.get("d")
            if name == "READY" and isinstance(data, dict):
                self.session_id = str(data["session_id"])
                self.resume_url = str(data.get("resume_gateway_url") or "") or None
                self.user = data.get("user") or {}
            if name in ("READY", "RESUMED"):
                self._report(None)
                self.ready.set()
            self._dispatch(name, data)
        elif op == 1:
            await ws.send(json.dumps({"op": 1, "d": self.seq}))
        elif op == 7:
            logger.info("discord: the gateway asked for a reconnect")
            await ws.close(RESUMING_CLOSE)
        elif op == 9:
            if not frame.get("d"):
                logger.info("discord: the session is no longer valid; identifying again")
                self.session_id = self.seq = None
                self._new_session_pause = random.uniform(1.0, 5.0)
            await ws.close(RESUMING_CLOSE)
        elif op == 11:
            self._acked = True

    async def _heartbeat(self, ws: ClientConnection, interval: float) -> None:
        """Beat every ``interval``; a beat still unacknowledged at the next one closes the
        connection (a zombie), to be resumed."""
        await asyncio.sleep(interval * random.random())
        while True:
            if not self._acked:
                logger.warning("discord: no heartbeat acknowledgement; reconnecting")
                await ws.close(RESUMING_CLOSE)
                return
            self._acked = False
            await ws.send(json.dumps({"op": 1, "d": self.seq}))
            await asyncio.sleep(interval)

    def _identify(self) -> dict[str, Any]:
        self.seq = None
        properties = {"os": "linux", "browser": "hermes-sessions", "device": "hermes-sessions"}
        return {"op": 2, "d": {
            "token": self._token, "intents": self._intents, "properties": properties,
        }}  # fmt: skip

    def _resume(self) -> dict[str, Any]:
        return {"op": 6, "d": {"token": self._token, "session_id": self.session_id,
                               "seq": self.seq}}  # fmt: skip

    def _report(self, problem: str | None) -> None:
        """Log a connection problem once (and its end)."""
        if problem != self.problem:
            if problem is not None:
                logger.warning("discord: %s", problem)
            elif self.problem is not None:
                logger.info("discord: the gateway connection works again")
        self.problem = problem
