"""Where a gateway is in its life, and the work it runs beside the lanes.

:class:`Phase` is what the parts that accept and dispatch events consult: behind the start-up
gate (events are queued, nothing is dispatched), running, or stopping (a drain: events are
queued for the next start). :class:`Background` holds the delayed retries (of a dispatch, of a
rate-limited reply) and the tasks beside the lanes (reply settles, the retries' work) that
``idle`` and ``stop`` wait for. The :class:`~hermes_core.gateway.runtime.Gateway` moves both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Phase:
    """The start-up gate and the stop under way; the gateway moves them, its parts read them."""

    def __init__(self) -> None:
        self.gate = True
        """Up until the turns a start resumed have ended: events are queued, none dispatched."""
        self.stopping: str | None = None
        """``restart`` or ``shutdown`` once a stop has begun (a drain: events are queued)."""

    @property
    def dispatching(self) -> bool:
        """Whether queued events may start now: the gate is down and no stop has begun."""
        return not self.gate and self.stopping is None


class Background:
    """Timers and the tasks that run beside the lanes; a stop cancels the timers."""

    def __init__(self, phase: Phase) -> None:
        self._phase = phase
        self._timers: set[asyncio.TimerHandle] = set()
        self.tasks: set[asyncio.Future[Any]] = set()
        """Running now: reply settles and the work of timers that fired."""

    def later(self, delay: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        """Call ``callback`` after ``delay`` seconds unless a stop has begun by then; a
        coroutine it returns runs as one of :attr:`tasks`."""
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            if self._phase.stopping is not None:
                return
            work = callback()
            if asyncio.iscoroutine(work):
                self.track(loop.create_task(work))

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)
        return handle

    def track(self, future: asyncio.Future[Any]) -> None:
        """Count ``future`` among :attr:`tasks` until it is done."""
        self.tasks.add(future)
        future.add_done_callback(self.tasks.discard)

    def cancel_timers(self) -> None:
        """A stop: no timer fires any more."""
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
