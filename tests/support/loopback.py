"""An ASGI app served over real HTTP on 127.0.0.1: in a thread of the test process
(:class:`LoopbackServer`, for the fake platform servers and the fake model endpoint), or on the
running event loop (:func:`served_here`, for an app that calls a gateway started on that loop)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import uvicorn

from hermes_core.serve.runner import AppServer

STARTUP_SECS = 10.0


def _config(app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", access_log=False
    )


@contextlib.asynccontextmanager
async def served_here(app: Any) -> AsyncIterator[str]:
    """``async with served_here(app) as url:`` serves ``app`` on a free port of 127.0.0.1 from
    the running event loop until the block ends."""
    server = AppServer(_config(app))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + STARTUP_SECS
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            raise RuntimeError("the loopback server did not start")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


class LoopbackServer:
    """``with LoopbackServer(app) as server:`` serves ``app`` on a free port of 127.0.0.1
    (``server.url``) until the block ends."""

    def __init__(self, app: Any) -> None:
        self._server = uvicorn.Server(_config(app))
        self._thread = threading.Thread(target=self._run, name="loopback-server", daemon=True)
        self.url = ""

    def _run(self) -> None:
        asyncio.run(self._server.serve())

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_SECS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the loopback server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(STARTUP_SECS)
