"""Lane wake-ups between the gateways of a shared PostgreSQL store: ``NOTIFY`` and ``LISTEN``.

A process that queues a command (``/stop``, ``/new``, ``/reset``) for a lane leased by another
process notifies the lane's key on :data:`CHANNEL` right after the enqueue's commit (a
notification goes out when its own transaction commits), so the holder finds the command
stored. Every process listens on a connection of its own, in a thread, and hands each key to
the gateway. A signal can be lost (the listening connection was cut, and is opened again after
a pause); the holder then finds the queued command when its running turn ends, as it would
without wake-ups.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from hermes_plugins.sql_store.connection import SqlConnection

logger = logging.getLogger(__name__)

CHANNEL = "hermes_lanes"
"""The notification channel every gateway of the database listens on."""

MAX_PAYLOAD = 7999
"""PostgreSQL's limit on a notification's payload, in bytes (a longer key is not signalled)."""

POLL_SECS = 0.25
"""How long the listener waits for a notification before it checks whether to stop."""

RETRY_SECS = (0.5, 30.0)
"""First and longest pause before the listener opens its connection again after a loss."""


class WakeupRows:
    """``LaneWakeups`` on PostgreSQL."""

    def __init__(self, conn: SqlConnection) -> None:
        self._conn = conn

    def wake_lane(self, session_key: str) -> None:
        """Notify ``session_key`` on :data:`CHANNEL` once the enclosing write commits."""
        if len(session_key.encode("utf-8", "surrogatepass")) > MAX_PAYLOAD:
            logger.debug("a lane key too long to signal waits for its holder's turn to end")
            return
        with self._conn.write("waking a lane's holder") as cursor:
            cursor.execute("SELECT pg_notify(%(channel)s, %(key)s)",
                           {"channel": CHANNEL, "key": session_key})  # fmt: skip

    def listen_lanes(self, woken: Callable[[str], None]) -> Callable[[], None]:
        """Listen on a connection of the pool, in a thread, until the returned function is
        called (it waits for the thread, at most :data:`POLL_SECS`)."""
        listener = _Listener(self._conn.engine.raw_connection, woken, self._conn.display)
        listener.start()
        return listener.stop


class _Listener:
    """The thread that holds a ``LISTEN`` connection and reports each notified key."""

    def __init__(
        self, connect: Callable[[], Any], woken: Callable[[str], None], display: str
    ) -> None:
        self._connect = connect
        self._woken = woken
        self._display = display
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hermes-lane-wakeups", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        pause = RETRY_SECS[0]
        while not self._stopping.is_set():
            try:
                self._listen()
                return
            except Exception as exc:  # noqa: BLE001 - a lost connection: listen again later
                logger.warning(
                    "%s: listening for lane wake-ups failed (%s); trying again in %.1f s "
                    "(meanwhile a /stop sent through another gateway waits for the turn to end)",
                    self._display, exc, pause,
                )  # fmt: skip
            if self._stopping.wait(pause):
                return
            pause = min(pause * 2, RETRY_SECS[1])

    def _listen(self) -> None:
        """Listen until stopped; raises when the connection fails."""
        pooled = self._connect()
        try:
            connection = pooled.driver_connection
            connection.autocommit = True
            connection.execute(f"LISTEN {CHANNEL}")
            while not self._stopping.is_set():
                for notice in connection.notifies(timeout=POLL_SECS):
                    self._report(notice.payload)
        finally:
            pooled.invalidate()  # never back to the pool: it is in autocommit and listening

    def _report(self, session_key: str) -> None:
        try:
            self._woken(session_key)
        except Exception:
            logger.exception("handling a lane wake-up failed")
