"""A TCP proxy in front of the test PostgreSQL server, to simulate an outage: while ``down``
every new connection is closed at once, as if the server were unreachable."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from sqlalchemy import make_url


class TcpProxy:
    """Forwards 127.0.0.1:<port> to the server of ``url``; ``down`` refuses new connections."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self._upstream = (parsed.host or "127.0.0.1", parsed.port or 5432)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = parsed.set(host="127.0.0.1", port=self.port).render_as_string(False)
        self.down = False
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pump(source: socket.socket, target: socket.socket) -> None:
    """Copy bytes one way until either side closes, then close both."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    for end in (source, target):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
        end.close()


@contextlib.contextmanager
def proxied(url: str) -> Iterator[TcpProxy]:
    """A proxy for the duration of a ``with`` block."""
    proxy = TcpProxy(url)
    try:
        yield proxy
    finally:
        proxy.close()
