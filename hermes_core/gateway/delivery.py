"""Delivering a reply: claim its ledger row, send it, settle it, one path for every occasion (a
turn, the boot sweep, a reconnect, a rate-limit retry, a takeover); and the host's adapters
(:class:`Platforms`), through which replies and notices are sent."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from hermes_core.domain.models import SessionSource
from hermes_core.gateway.agents import Adapter, EditingAdapter
from hermes_core.gateway.lifecycle import Background
from hermes_core.gateway.ownership import LaneOwnership
from hermes_core.gateway.streaming import RECOVERED_NOTE, Commit, Layout, render
from hermes_core.store import SessionStore
from hermes_core.store.backend import Obligation
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.ledger import Occasion, SendResult
from hermes_core.turns.pipeline import Turn, TurnPipeline

logger = logging.getLogger(__name__)

RATE_LIMIT_RETRY_SECS = 5.0
"""Wait before a rate-limited reply is sent again (times its attempts so far)."""


def _delivered() -> None:
    """After a delivery's settle commit: the row is gone, the turn closed."""
    crash_point("marker_cleared")


class Platforms:
    """The host's adapters by platform: which are connected, and what is sent through them."""

    def __init__(self, adapters: Mapping[str, Adapter]) -> None:
        self._adapters = adapters

    def connected(self, platform: str) -> bool:
        """Whether the platform has an adapter and it is connected."""
        adapter = self._adapters.get(platform)
        return adapter is not None and adapter.is_connected()

    def connected_names(self) -> list[str]:
        """The platforms connected now."""
        return [name for name, adapter in self._adapters.items() if adapter.is_connected()]

    async def reply(self, source: SessionSource, text: str) -> None:
        """A direct (unledgered) message: acknowledgements, notices, command replies; a failure
        to send one is logged, never raised."""
        adapter = self._adapters.get(source.platform)
        if adapter is None or not adapter.is_connected():
            logger.warning("no connected adapter for %s; a notice was not sent", source.platform)
            return
        try:
            await adapter.send(source, text)
        except Exception:
            logger.exception("a notice could not be sent")

    async def send(
        self,
        row: Obligation,
        text: str,
        source: SessionSource | None = None,
        stream: tuple[Layout, Commit] | None = None,
    ) -> SendResult:
        """Send a claimed reply through its platform's adapter (on the loop), to ``source``
        (the turn's) or else to the chat and thread the row names; a streamed reply (its
        messages' ``Layout`` and how to store it) by editing its messages into ``text``."""
        adapter = self._adapters.get(row.platform)
        if adapter is None or not adapter.is_connected():
            return SendResult(ok=False, failure_kind="disconnected", error="not connected")
        if source is None:
            source = SessionSource(platform=row.platform, chat_id=row.chat_id or "",
                                   chat_type="group", thread_id=row.thread_id)  # fmt: skip
        reply_to = row.reply_to_message_id
        try:
            if stream is not None and isinstance(adapter, EditingAdapter):
                layout, commit = stream
                return await render(adapter, source, layout, text, commit, reply_to=reply_to)
            return await adapter.send(source, text, reply_to=reply_to)
        except Exception as exc:  # noqa: BLE001 - a raising adapter is a failed send
            return SendResult(ok=False, failure_kind="disconnected", error=repr(exc))


class Delivery:
    """Sends owed replies through their adapter and settles their ledger rows; closes a turn
    that owes nothing."""

    def __init__(
        self,
        store: SessionStore,
        pipeline: TurnPipeline,
        platforms: Platforms,
        ownership: LaneOwnership,
        background: Background,
        stream_commit: Callable[[str], Commit],
    ) -> None:
        self._store = store
        self._stream_commit = stream_commit
        """How a lane's streamed reply layout is stored (``Streams.commit``): for a reply
        without a ledger row, whose turn still holds the lane's record."""
        self._pipeline = pipeline
        self._platforms = platforms
        self._ownership = ownership
        self._background = background
        self._sending: set[str] = set()
        """Ledger rows being sent right now (never sent twice at once)."""

    async def deliver(
        self,
        row: Obligation,
        *,
        prefix: str | None = None,
        turn: Turn | None = None,
        success: bool = True,
        claimed: bool = False,
        close: bool = False,
        layout: Layout | None = None,
    ) -> bool:
        """The one claim → send → settle path, for turns, the boot sweep, reconnects and
        rate-limit retries. A turn's reply arrives claimed (``claimed``); settling also closes
        the turn, or with ``close`` (the boot sweep) clears the lane's resume flag. A turn does
        not wait for its settle; a sweep does (after the boot sweep the lanes are resumed: an
        answered turn must not look interrupted). A streamed reply (its ``layout``, the turn's,
        or the one its row keeps for a reply sent outside its turn) is delivered by editing its
        messages; outside its turn it is marked as recovered. True when the platform accepted
        the reply."""
        ident = row.obligation_id
        if ident and ident in self._sending:
            return False
        if ident:
            self._sending.add(ident)
        try:
            ledger = self._store._obligations.ledger
            if not claimed and ident and ledger is not None:
                claim = functools.partial(ledger.claim, marked=prefix is not None)
                claimed_row = await self._store.arun(claim, row, lane=row.session_key)
                if claimed_row is None:  # no attempt left: abandoned
                    if turn is not None:
                        await self.close(turn, success=success)
                    return False
                row = claimed_row
            source = turn.event.source if turn is not None else None
            if turn is None:
                source, layout = await self._origin(row), Layout.from_json(row.stream_messages)
            text = f"{prefix}\n\n{row.content}" if prefix else row.content
            stream = None
            if layout is not None:
                stream = (layout, self._commit(row))
                text = row.content if turn is not None else f"{row.content}\n\n{RECOVERED_NOTE}"
            result = await self._platforms.send(row, text, source, stream)
            if result.ok:
                crash_point("sent")
            settling = self._settle(row, result, turn, success, close)
            if turn is None:  # a sweep's send: settled before the sweep goes on
                await asyncio.wait([settling])
            return result.ok
        finally:
            self._sending.discard(ident)

    def _commit(self, row: Obligation) -> Commit:
        """How a streamed reply's new messages are stored while it is delivered: in its ledger
        row (a writer step of its lane), or without a row in the lane's record."""
        ledger = self._store._obligations.ledger
        if ledger is None or not row.obligation_id:
            return self._stream_commit(row.session_key)
        update = functools.partial(ledger.rows.update_obligation, row.obligation_id)

        async def store(layout: Layout) -> None:
            changes = {"stream_messages": layout.to_json()}
            await self._store.arun(update, changes, lane=row.session_key)

        return store

    async def _origin(self, row: Obligation) -> SessionSource | None:
        """Where an owed reply goes when no turn carries its source: the lane's stored origin
        (its chat type and scope, which a connector may need to send), in the row's chat and
        thread (None when the lane is gone or now names another chat)."""
        try:
            entry = await asyncio.to_thread(self._store.lookup_by_session_key, row.session_key)
        except Exception:
            logger.exception("the lane of an owed reply could not be read; sending by its row")
            return None
        origin = entry.origin if entry is not None else None
        if origin is None or origin.platform != row.platform or origin.chat_id != row.chat_id:
            return None
        return origin.replace(thread_id=row.thread_id)

    async def close(self, turn: Turn, *, success: bool) -> None:
        """Close a turn that owes nothing; a store failure leaves its marker (logged), so the
        turn is resumed after the next restart rather than lost."""
        try:
            close = functools.partial(self._store._turns.close_turn, success=success)
            await self._store.arun(close, turn.key, turn.token, lane=turn.key)
        except Exception:
            logger.exception("a turn could not be closed; its marker stays set")

    def _settle(
        self,
        row: Obligation,
        result: SendResult,
        turn: Turn | None,
        success: bool,
        close: bool,
    ) -> asyncio.Future[bool]:
        """Settle a send (the turn's last commit) without holding up the lane: the step is
        handed to the writer now, so the lane's next step queues behind it and can never
        overtake it; ``idle`` and ``stop`` wait for it. A turn's settle may let go of the lane
        (see :meth:`_settle_step`): the ownership learns that it is pending."""
        key = row.session_key
        settling = self._store.submit(
            self._settle_step, row, result, turn, success, close, lane=key
        )
        self._background.track(settling)
        settling.add_done_callback(functools.partial(self._settled, row, result))
        if turn is not None:
            self._ownership.settle_pending(key, settling)
        return settling

    def _settle_step(
        self,
        row: Obligation,
        result: SendResult,
        turn: Turn | None,
        success: bool,
        close: bool,
    ) -> bool:
        """Writer step: settle the ledger row and close the turn; the crash points of a
        delivery pass once this is committed. A turn's lane may be let go in the same statement (the
        ownership says: see ``LaneOwnership.release_in_settle``). It reads what the delivery
        was built with and its arguments, nothing the loop changes."""
        kept = self._ownership.release_in_settle(row.session_key) if turn is not None else None
        delivered = self._pipeline.settle(row, result, turn, success, close, kept)
        if delivered:
            self._store._writer.after_commit(_delivered)
        return delivered

    def _settled(self, row: Obligation, result: SendResult, settling: asyncio.Future[bool]) -> None:
        if settling.cancelled():
            return
        error = settling.exception()
        if error is not None:
            logger.error("a send could not be settled; the reply stays owed: %s", error)
        elif not settling.result() and result.failure_kind == "rate_limited":
            retry = functools.partial(self.send_due, "rate_limit", [row.platform])
            wait = result.retry_after or RATE_LIMIT_RETRY_SECS * max(1, row.attempts)
            self._background.later(wait, retry)

    async def send_due(
        self,
        occasion: Occasion,
        platforms: Sequence[str],
        lanes: Callable[[str], bool] | None = None,
    ) -> None:
        """Send the owed replies of ``platforms`` for an occasion (see ``DeliveryLedger.due``),
        of ``lanes`` only if given, else of the lanes the ownership answers for."""
        ledger = self._store._obligations.ledger
        if ledger is None or not platforms:
            return
        try:
            due = await self._store.arun(
                ledger.due, occasion, platforms, frozenset(self._sending),
                lanes or self._ownership.held,
            )  # fmt: skip
        except Exception:
            logger.exception("owed replies could not be read (%s)", occasion)
            return
        for row, prefix in due:
            await self.deliver(row, prefix=prefix, close=occasion in ("boot", "takeover"))
