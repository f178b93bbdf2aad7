"""A fake IRC server on the loopback interface for the example IRC connector's tests.

It registers a client (NICK/USER, then the 001 welcome), records every line the client sends,
sends the client PRIVMSG and PING lines on a test's request, and drops the connection. It can
refuse a wrong server password (464) and report the first nickname as taken (433).
"""

from __future__ import annotations

import asyncio
import contextlib


class FakeIrc:
    """An IRC server holding one client connection at a time."""

    def __init__(self, *, password: str | None = None, taken: set[str] | None = None) -> None:
        self.password = password
        self.taken = taken or set()
        self.received: list[str] = []
        """Every line received, CRLF removed, in order (across connections)."""
        self.connections = 0
        """Connections registered (welcomed) so far."""
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> int:
        """Listen on 127.0.0.1 (``port`` 0: a free port); the port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def lines(self, command: str) -> list[str]:
        """The received lines of ``command``."""
        return [line for line in self.received if line.split(" ", 1)[0] == command]

    def say(self, nick: str, target: str, text: str) -> None:
        """``nick`` sends PRIVMSG ``text`` to ``target`` (a channel or the bot's nickname)."""
        self._send(f":{nick}!{nick.lower()}@example.net PRIVMSG {target} :{text}")

    def ping(self, token: str) -> None:
        self._send(f"PING :{token}")

    def drop(self) -> None:
        """Close the client's connection, as a server or network failure would."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def _send(self, line: str) -> None:
        assert self._writer is not None, "no client is connected"
        self._writer.write(line.encode("utf-8") + b"\r\n")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        given: str | None = None
        nick: str | None = None
        user = False
        with contextlib.suppress(ConnectionError):
            while raw := await reader.readline():
                line = raw.decode("utf-8").rstrip("\r\n")
                self.received.append(line)
                command, _, rest = line.partition(" ")
                if command == "PASS":
                    given = rest.removeprefix(":")
                elif command == "NICK" and rest in self.taken:
                    writer.write(f":fake 433 * {rest} :Nickname is already in use\r\n".encode())
                elif command == "NICK":
                    nick = rest
                user = user or command == "USER"
                if user and nick is not None and self._writer is not writer:
                    if self.password is not None and given != self.password:
                        writer.write(b":fake 464 * :Password incorrect\r\n")
                        await writer.drain()
                        writer.close()
                        return
                    self.connections += 1
                    self._writer = writer
                    writer.write(f":fake 001 {nick} :Welcome to the fake network\r\n".encode())
                await writer.drain()
        if self._writer is writer:
            self._writer = None
