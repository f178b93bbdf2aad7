"""One begun turn, from the agent to its reply: the agent from the cache, the session-context
prompt and the message, the agent's turn on the loop, then the reply stored and recorded (one
commit) and delivered; every stage is guarded, so a failure never stops the lane."""

from __future__ import annotations

import asyncio
import logging
import operator
from collections.abc import Callable

from hermes_core.config.schema import GatewayConfig
from hermes_core.domain.errors import LeaseLostError
from hermes_core.domain.models import SessionContext, SessionEntry, SessionSource
from hermes_core.domain.recent import Recent
from hermes_core.gateway.agents import Agent, TurnRequest
from hermes_core.gateway.cache import AgentCache
from hermes_core.gateway.context import (
    build_session_context,
    build_session_context_prompt,
    prefix_sender,
)
from hermes_core.gateway.delivery import Delivery, Platforms
from hermes_core.gateway.lanes import Lane
from hermes_core.gateway.streams import Streams, stop_indicator
from hermes_core.gateway.texts import SUSPENDED_NOTICE, TURN_FAILED
from hermes_core.plugins.manager import HermesPluginManager
from hermes_core.store import SessionStore
from hermes_core.turns.crashpoints import crash_point
from hermes_core.turns.pipeline import Turn, TurnPipeline

logger = logging.getLogger(__name__)

PROMPT_CACHE_SIZE = 1024
"""How many (session id, source field values...) keys keep their session-context prompt."""

_source_values = operator.attrgetter(*SessionSource.model_fields)
"""A source's field values in field order (read in C, like hashing the tuple they go into)."""


class TurnRunner:
    """Runs begun turns: the agent, the reply's commit, its delivery."""

    def __init__(
        self,
        config: GatewayConfig,
        plugins: HermesPluginManager,
        store: SessionStore,
        pipeline: TurnPipeline,
        cache: AgentCache[Agent],
        agent_factory: Callable[[SessionEntry], Agent],
        delivery: Delivery,
        platforms: Platforms,
        streams: Streams,
    ) -> None:
        self._config = config
        self._streams = streams
        self._plugins = plugins
        self._store = store
        self._pipeline = pipeline
        self._cache = cache
        self._agent_factory = agent_factory
        self._delivery = delivery
        self._platforms = platforms
        self._prompts: Recent[tuple[object, ...], tuple[str, SessionContext]]
        self._prompts = Recent(PROMPT_CACHE_SIZE)
        """The session-context prompts of the most recently used (session id, source field
        values...) keys."""

    async def run(self, lane: Lane, turn: Turn) -> None:
        """One begun turn: the agent on the loop, then the reply stored and recorded (one
        commit), sent, and settled with the turn closed (one commit)."""
        key = turn.key
        try:
            agent = self._cache.get_or_create(
                key, turn.entry.session_id, lambda: self._agent_factory(turn.entry),
                begin_turn=True,
            )  # fmt: skip
        except Exception:
            logger.exception("the lane's agent could not be built")
            await self._turn_failed(turn)
            return
        try:
            await self._agent_turn(lane, turn, agent)
        finally:
            self._cache.end_turn(key, agent)
            # The turn's user message and reply are in the store: nothing held only in memory.
            self._cache.report_persistence(key, agent, persisted=2, in_memory=2)

    async def _agent_turn(self, lane: Lane, turn: Turn, agent: Agent) -> None:
        lane.agent = agent
        reply: str | None = None
        failed = False
        streamer = await self._streams.streamer(lane, turn)
        lane.in_agent = lane.stop is None
        indicator = self._streams.typing(turn.event.source)
        try:
            if lane.stop is not None:  # halted while the turn was being stored
                raise asyncio.CancelledError
            request = self._request(turn)
            if turn.suspended_before and not turn.event.internal:
                await self._platforms.reply(turn.event.source, SUSPENDED_NOTICE)
            reply = await self._streams.reply(agent.run_turn(request), streamer, lane, indicator)
        except asyncio.CancelledError:
            if lane.stop != "user":
                raise  # a drain keeps the marker: the turn resumes after the restart
            if streamer is None or streamer.layout is None:
                await self._delivery.close(turn, success=False)  # nothing owed, no resume
                raise
            reply = streamer.text  # a stream stopped by the user ends with the text so far
        except Exception:
            logger.exception("a turn failed")
            failed = True
            await self._platforms.reply(turn.event.source, TURN_FAILED)
        finally:
            lane.in_agent = False
            await stop_indicator(indicator)
        layout = streamer.layout if streamer is not None else None
        success = not failed and not lane.interrupted
        shown = layout.to_json() if layout is not None else None
        try:
            owed = await self._store.submit(
                self._pipeline.finish, turn, None if failed else reply, success, shown,
                lane=turn.key,
            )  # fmt: skip
        except LeaseLostError as exc:  # another gateway took the lane over and resumes it
            logger.warning("a turn stopped without writing its reply: %s", exc)
            return
        except Exception:
            logger.exception("a turn's reply could not be stored")
            if not failed:
                await self._platforms.reply(turn.event.source, TURN_FAILED)
            await self._delivery.close(turn, success=False)
            return
        if owed is None:  # the turn's end dropped its stream's record too
            crash_point("marker_cleared")
            return
        crash_point("reply_stored")
        await self._delivery.deliver(
            owed.row, turn=turn, success=success, claimed=owed.ledgered, layout=layout
        )

    async def _turn_failed(self, turn: Turn) -> None:
        await self._platforms.reply(turn.event.source, TURN_FAILED)
        await self._delivery.close(turn, success=False)

    def _request(self, turn: Turn) -> TurnRequest:
        """The agent's input: the session-context prompt (cached per session and source: it is
        byte-identical from turn to turn) and the message; the history loads on demand."""
        source, session_id = turn.event.source, turn.entry.session_id
        # The source stands in the key as its field values (in field order): hashing and
        # comparing that tuple runs in C, a SessionSource's own __hash__ and __eq__ in Python.
        prompts, cache_key = self._prompts, (session_id, *_source_values(source))
        cached = prompts.use(cache_key)
        if cached is None:
            plugins = self._plugins
            context = build_session_context(source, self._config, turn.entry, plugins=plugins)
            cached = (build_session_context_prompt(context, plugins=plugins), context)
            prompts.put(cache_key, cached)
        prompt, context = cached
        text = turn.event.text
        if context.shared_multi_user_session and not turn.event.internal:
            text = prefix_sender(text, source, context, plugins=self._plugins)
        store = self._store
        return TurnRequest(
            turn.key, session_id, prompt, turn.message(text), turn.event,
            lambda: store.load_transcript(session_id)[:-1],
        )  # fmt: skip
