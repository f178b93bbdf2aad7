"""The turn runner's side of streamed replies and typing indicators: which turns stream, what a
cut stream left is told, how an agent's chunks become the reply (see
:mod:`hermes_core.gateway.streaming` for the display and the crash rules)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Mapping

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.models import SessionSource
from hermes_core.gateway.agents import Adapter, EditingAdapter, TypingAdapter
from hermes_core.gateway.lanes import Lane
from hermes_core.gateway.streaming import (
    CUT_PART,
    INTERRUPTED_NOTE,
    STREAM_METADATA,
    Commit,
    Layout,
    Streamer,
)
from hermes_core.store import SessionStore
from hermes_core.turns.pipeline import Turn

__all__ = ["Streams", "stop_indicator"]

logger = logging.getLogger(__name__)

Abilities = tuple[EditingAdapter | None, TypingAdapter | None]


class Streams:
    """Streamed replies and typing indicators for the turns of one gateway."""

    def __init__(
        self, config: GatewayConfig, store: SessionStore, adapters: Mapping[str, Adapter]
    ) -> None:
        self._settings = config.streaming
        self._store = store
        self._adapters = adapters
        self._abilities: dict[str, tuple[Adapter | None, Abilities]] = {}
        """Per platform, its adapter and what that adapter can do (a protocol check costs
        microseconds, twice a turn: it is made again only when the adapter changes)."""

    def _able(self, platform: str) -> Abilities:
        """The platform's adapter as an editing adapter and as a typing one (None where not)."""
        adapter = self._adapters.get(platform)
        known = self._abilities.get(platform)
        if known is None or known[0] is not adapter:
            editing = adapter if isinstance(adapter, EditingAdapter) else None
            typing = adapter if isinstance(adapter, TypingAdapter) else None
            known = self._abilities[platform] = (adapter, (editing, typing))
        return known[1]

    def streams_to(self, platform: str) -> bool:
        """Whether the platform's replies are shown as they grow (streaming on, an adapter
        that can edit)."""
        return self._settings.enabled and self._able(platform)[0] is not None

    def commit(self, key: str) -> Commit:
        """Stores a lane's layout in its metadata (a writer step of the lane, awaited)."""

        async def store(layout: Layout) -> None:
            write = functools.partial(
                self._store.set_session_metadata, key, STREAM_METADATA, layout.to_metadata()
            )
            await self._store.arun(write, lane=key)

        return store

    async def streamer(self, lane: Lane, turn: Turn) -> Streamer | None:
        """The turn's streamer, or None when its reply is not shown as it grows (streaming off,
        an adapter that cannot edit). A stream an earlier turn left cut (its messages are still
        the lane's: the turn ended in a crash before its reply was stored) is first edited to
        say so, and the record replaced by this turn's (under way, no messages yet; a turn that
        does not stream drops it at its end)."""
        source = turn.event.source
        adapter, _ = self._able(source.platform)
        left = Layout.from_metadata(turn.entry.metadata.get(STREAM_METADATA))
        if left is not None and left.messages:
            if adapter is not None:
                await _mark_cut(adapter, source, left)
            await self.commit(turn.key)(Layout())
        if not self._settings.enabled or adapter is None:
            return None
        return Streamer(
            adapter, source, turn.event.message_id, self._settings.edit_interval_secs,
            self.commit(turn.key), lambda: lane.stop is not None,
        )  # fmt: skip

    def typing(self, source: SessionSource) -> asyncio.Task[None] | None:
        """Show the chat that the bot is typing until the reply is shown (or the turn ends)."""
        _, adapter = self._able(source.platform)
        if adapter is None:
            return None
        return asyncio.create_task(_keep_typing(adapter, source))

    async def reply(
        self,
        outcome: object,
        streamer: Streamer | None,
        lane: Lane,
        indicator: asyncio.Task[None] | None,
    ) -> str | None:
        """The agent's reply from what ``run_turn`` returned: a finished string (or None), or
        an async iterator of chunks, shown as it grows when ``streamer`` is given."""
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome is None or isinstance(outcome, str):
            return outcome
        if not isinstance(outcome, AsyncIterator):
            raise TypeError(f"run_turn returned {type(outcome).__name__}, not text or chunks")
        if streamer is None:
            return "".join([str(chunk) async for chunk in outcome])

        def waiting(agent: bool) -> None:
            lane.in_agent = agent and lane.stop is None
            if streamer.layout is not None and indicator is not None:
                indicator.cancel()  # the reply is in the chat now

        return await streamer.consume(outcome, waiting)


async def _mark_cut(adapter: EditingAdapter, source: SessionSource, left: Layout) -> None:
    """Edit a cut stream's messages: the first says the reply was interrupted, the others are
    emptied (to :data:`CUT_PART`), so that none of its text stands beside the new reply."""
    for index, (message_id, _) in enumerate(left.messages):
        text = INTERRUPTED_NOTE if index == 0 else CUT_PART
        result = await adapter.edit(source, message_id, text)
        if not result.ok:
            logger.warning("a cut streamed reply could not be marked: %s", result.error)


async def _keep_typing(adapter: TypingAdapter, source: SessionSource) -> None:
    while True:
        try:
            await adapter.typing(source)
        except Exception:
            logger.exception("the typing indicator failed")
        await asyncio.sleep(max(0.01, adapter.typing_interval_secs))


async def stop_indicator(task: asyncio.Task[None] | None) -> None:
    """Stop a typing indicator's task."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
