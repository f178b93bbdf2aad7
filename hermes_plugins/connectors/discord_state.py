"""What the Discord connector remembers across restarts: per channel (or thread), the id of the
last message it handed over (stored by the gateway, or not a user message), so that after a
restart it reads what came after it (``GET /channels/{id}/messages?after=``).

The file (JSON, ``{"<channel id>": "<message id>"}``) is written atomically (a temporary file
renamed over it), at most once per :data:`FLUSH_SECS`, so it may lag behind what was stored
(those messages are read again and answered once, thanks to the gateway's redelivery records)
but is never ahead of it. A channel met for the first time is written at once, with the id just
below its first message, so that a crash before the next write still reads that message again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path

__all__ = ["FLUSH_SECS", "LastSeen"]

logger = logging.getLogger(__name__)

FLUSH_SECS = 1.0


class LastSeen:
    """Per channel, the newest message id handed over, kept in ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids: dict[str, int] = {}
        self._dirty = False
        self._flusher: asyncio.Task[None] | None = None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError) as exc:
            logger.error("discord: %s cannot be read (%s); no channel will be caught up", path,
                         exc)  # fmt: skip
            data = {}
        if isinstance(data, dict):
            self._ids = {str(k): int(v) for k, v in data.items() if str(v).isdecimal()}

    def channels(self) -> dict[str, str]:
        """Each known channel's last message id."""
        return {channel: str(last) for channel, last in self._ids.items()}

    def know(self, channel: str, message_id: str) -> None:
        """Remember a channel met for the first time, just below its first message; written
        now."""
        if channel not in self._ids and message_id.isdecimal():
            self._ids[channel] = int(message_id) - 1
            self.write()

    def advance(self, channel: str, message_id: str) -> None:
        """Move the channel's id up to ``message_id`` (never down); written within
        :data:`FLUSH_SECS`."""
        if message_id.isdecimal() and int(message_id) > self._ids.get(channel, -1):
            self._ids[channel] = int(message_id)
            self._dirty = True
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_later(), name="discord-state")

    def forget(self, channel: str) -> None:
        """Drop a channel that is gone (unknown, or no longer readable)."""
        if self._ids.pop(channel, None) is not None:
            self._dirty = True

    async def _flush_later(self) -> None:
        await asyncio.sleep(FLUSH_SECS)
        self.write()

    async def close(self) -> None:
        """Write what is left and stop the pending write."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        self.write()

    def write(self) -> None:
        """Write the file now (atomically); a failure is logged, the ids stay to write later."""
        self._dirty = False
        data = json.dumps({channel: str(last) for channel, last in self._ids.items()})
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(data, encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError as exc:
            self._dirty = True
            logger.error("discord: cannot write %s (%s)", self.path, exc)
