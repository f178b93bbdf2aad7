"""Delivering a reply: claim its ledger row, send it, settle it, one path for every occasion (a
turn, the boot sweep, a reconnect, a rate-limit retry)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

from hermes_core.gateway.core import GatewayCore
from hermes_core.store.backend import Obligation
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.ledger import Occasion, SendResult
from hermes_core.turns.pipeline import Turn

logger = logging.getLogger(__name__)

RATE_LIMIT_RETRY_SECS = 5.0
"""Wait before a rate-limited reply is sent again (times its attempts so far)."""


def _delivered() -> None:
    """After a delivery's settle commit: the row is gone, the turn closed."""
    crash_point("marker_cleared")


class Delivery(GatewayCore):
    """Sends owed replies through their adapter and settles their ledger rows."""

    async def _deliver(
        self,
        row: Obligation,
        *,
        prefix: str | None = None,
        turn: Turn | None = None,
        success: bool = True,
        claimed: bool = False,
        close: bool = False,
    ) -> bool:
        """The one claim → send → settle path, for turns, the boot sweep, reconnects and
        rate-limit retries. A turn's reply arrives claimed (``claimed``); settling also closes
        the turn, or with ``close`` (the boot sweep) clears the lane's resume flag. A turn does
        not wait for its settle; a sweep does (after the boot sweep the lanes are resumed: an
        answered turn must not look interrupted). True when the platform accepted the reply."""
        ident = row.obligation_id
        if ident and ident in self._sending:
            return False
        if ident:
            self._sending.add(ident)
        try:
            ledger = self.store.ledger
            if not claimed and ident and ledger is not None:
                claim = functools.partial(ledger.claim, marked=prefix is not None)
                claimed_row = await self.store.arun(claim, row, lane=row.session_key)
                if claimed_row is None:  # no attempt left: abandoned
                    if turn is not None:
                        await self._close(turn, success=success)
                    return False
                row = claimed_row
            text = f"{prefix}\n\n{row.content}" if prefix else row.content
            result = await self._send(row, text, turn.event.source if turn is not None else None)
            if result.ok:
                crash_point("sent")
            settling = self._settle(row, result, turn, success, close)
            if turn is None:  # a sweep's send: settled before the sweep goes on
                await asyncio.wait([settling])
            return result.ok
        finally:
            self._sending.discard(ident)

    def _settle(
        self, row: Obligation, result: SendResult, turn: Turn | None, success: bool, close: bool
    ) -> asyncio.Future[bool]:
        """Settle a send (the turn's last commit) without holding up the lane: the step is
        handed to the writer now, so the lane's next step queues behind it and can never
        overtake it; ``idle`` and ``stop`` wait for it. On a shared store a turn's settle may
        release the lane's lease (see :meth:`_settle_step`): until it is done, a lane that runs
        dry leaves its lease alone, and once it is, the lane is dispatched again (kept with
        events to run, or still held)."""
        key = row.session_key
        settling = self.store.submit(self._settle_step, row, result, turn, success, close, lane=key)
        self._background.add(settling)
        settling.add_done_callback(functools.partial(self._settled, row, result))
        if turn is not None and self.shared is not None:
            self._settling[key] = settling
            settling.add_done_callback(functools.partial(self._lane_settled, key))
        return settling

    def _lane_settled(self, key: str, settling: asyncio.Future[bool]) -> None:
        if self._settling.get(key) is settling:
            del self._settling[key]
            self._dispatch_next(key)

    def _settle_step(
        self, row: Obligation, result: SendResult, turn: Turn | None, success: bool, close: bool
    ) -> bool:
        """Writer step: settle the ledger row and close the turn; the crash points of a
        delivery pass once this is committed. A turn's lane on a shared store with nothing
        queued here gives its lease up in the same statement, unless events wait in its durable
        queue (then it is kept and those events are loaded here to run next)."""
        key = row.session_key
        shared = self.shared
        release = (
            turn is not None and shared is not None and not shared.recovering(key)
            and self._queue.depth(key) == 0
        )  # fmt: skip
        kept = functools.partial(self._queue.reload, key) if release else None
        delivered = self._pipeline.settle(row, result, turn, success, close, kept)
        if delivered:
            self.store.after_commit(_delivered)
        return delivered

    def _settled(self, row: Obligation, result: SendResult, settling: asyncio.Future[bool]) -> None:
        self._background.discard(settling)
        if settling.cancelled():
            return
        error = settling.exception()
        if error is not None:
            logger.error("a send could not be settled; the reply stays owed: %s", error)
        elif not settling.result() and result.failure_kind == "rate_limited":
            retry = functools.partial(self._send_due, "rate_limit", [row.platform])
            self._later(RATE_LIMIT_RETRY_SECS * max(1, row.attempts), retry)

    async def _send_due(
        self,
        occasion: Occasion,
        platforms: Sequence[str],
        lanes: Callable[[str], bool] | None = None,
    ) -> None:
        """Send the owed replies of ``platforms`` for an occasion (see ``DeliveryLedger.due``),
        of ``lanes`` only if given (on a shared store, of the lanes this process holds)."""
        ledger = self.store.ledger
        if ledger is None or not platforms:
            return
        try:
            mine = self.store.holds if self.store.shared else None  # start-up's sweep too
            due = await self.store.arun(
                ledger.due, occasion, platforms, frozenset(self._sending), lanes or mine
            )
        except Exception:
            logger.exception("owed replies could not be read (%s)", occasion)
            return
        for row, prefix in due:
            await self._deliver(row, prefix=prefix, close=occasion in ("boot", "takeover"))
