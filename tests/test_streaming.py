"""Streamed replies in process: one message edited in place ending with exactly the finished
text, edits spaced by ``streaming.edit_interval_secs``, silence held back, a reply past the limit
continued in a new message, ``/stop`` ending a stream with its text so far, typing indicators,
an adapter that cannot edit getting the finished reply, and what a restart does with a stream
that was cut (its reply stored or not)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from support.streaming import EditingChats, StreamingAgent

from hermes_core import Agent, Gateway, GatewayConfig, InMemoryAdapter, MessageEvent, SessionStore
from hermes_core.gateway.streaming import (
    CUT_PART,
    INTERRUPTED_NOTE,
    RECOVERED_NOTE,
    STREAM_METADATA,
)
from hermes_core.testing import fresh_plugin_manager, telegram_dm
from hermes_core.turns.ledger import SILENCE_NOTICE, could_become_silent

CHAT = "77"


def _config(home: Path, **streaming: Any) -> GatewayConfig:
    data = {
        "gateway": {"housekeeping": {"initial_delay_secs": 3600}},
        "streaming": {"edit_interval_secs": 0.0, **streaming},
    }
    return GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(home)})


def _event(text: str, message_id: str = "501") -> MessageEvent:
    return MessageEvent(source=telegram_dm(CHAT, user_id=CHAT), text=text, message_id=message_id)


Run = Callable[..., Any]


@pytest.fixture
def run(hermes_home: Path) -> Run:
    """Runs one gateway with ``agent`` over ``chats`` until ``body`` is done and it is idle."""

    async def go(
        agent: Agent, chats: Any, body: Callable[[Gateway], Any], **streaming: Any
    ) -> Gateway:
        config = _config(hermes_home, **streaming)
        plugins = fresh_plugin_manager(hermes_home)
        async with Gateway(config, plugins, lambda entry: agent, [chats]) as gateway:
            await body(gateway)
            await gateway.idle()
        return gateway

    return go


async def _say(gateway: Gateway, text: str = "hi", message_id: str = "501") -> None:
    await gateway.handle_message(_event(text, message_id))


def _stored(home: Path) -> tuple[list[dict[str, Any]], object, int]:
    """The lane's transcript, its stream record and the owed replies, read after a stop."""
    config = _config(home)
    with SessionStore(config.sessions_dir, config) as store:
        key = store.session_key_for(telegram_dm(CHAT, user_id=CHAT))
        entry = store.lookup_by_session_key(key)
        assert entry is not None
        ledger = store._obligations.ledger
        assert ledger is not None
        owed = len(ledger.rows.obligations(("pending", "attempting", "failed")))
        return store.load_transcript(entry.session_id), entry.metadata.get(STREAM_METADATA), owed


@pytest.mark.parametrize(
    ("text", "may"),
    [("", True), ("  ", True), ("[SIL", True), ("silent.", True), ("No", True), ("NO_REP", True),
     ("No, I", False), ("Hello", False), ("[SILENT] but more", False), ("x" * 65, False)],
)  # fmt: skip
def test_text_that_may_still_become_a_silence_marker_is_held(text: str, may: bool) -> None:
    assert could_become_silent(text) is may


async def test_a_streamed_reply_grows_in_one_message_and_ends_as_the_finished_text(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats()
    await run(StreamingAgent(["Hello", " wor", "ld, how", " are you?"]), chats, _say)
    (message,) = chats.messages
    assert (message.text, message.reply_to) == ("Hello world, how are you?", "501")
    assert message.edits >= 1  # it grew in place
    transcript, record, owed = _stored(hermes_home)
    assert transcript[-1]["content"] == "Hello world, how are you?"
    assert (record, owed) == (None, 0)


async def test_edits_are_spaced_by_the_interval(run: Run) -> None:
    chats = EditingChats()
    agent = StreamingAgent([f"word{n} " for n in range(30)], pause=0.02)  # about 0.6 s
    await run(agent, chats, _say, edit_interval_secs=0.25)
    (message,) = chats.messages
    assert message.text == "".join(agent.chunks)
    assert 1 <= message.edits <= 4  # at most one per 0.25 s, and the final one


async def test_a_silence_only_stream_sends_only_the_silence_notice(run: Run) -> None:
    chats = EditingChats()
    await run(StreamingAgent(["[SIL", "ENT", "]"]), chats, _say)
    assert chats.texts(CHAT) == [SILENCE_NOTICE]
    assert chats.messages[0].edits == 0


async def test_a_stream_past_the_limit_continues_in_a_new_message(run: Run) -> None:
    chats = EditingChats(message_limit=60)
    words = [f"sentence number {n} is here. " for n in range(8)]  # about 230 characters
    await run(StreamingAgent(words, pause=0.001), chats, _say)
    texts = chats.texts(CHAT)
    assert len(texts) >= 4
    assert all(len(text) <= 60 for text in texts)
    assert "".join(texts) == "".join(words)
    assert [m.reply_to for m in chats.messages] == ["501"] + [None] * (len(texts) - 1)


async def test_an_adapter_that_cannot_edit_gets_the_finished_reply(
    run: Run, hermes_home: Path
) -> None:
    adapter = InMemoryAdapter("telegram")
    await run(StreamingAgent(["one ", "two ", "three"]), adapter, _say)
    assert adapter.texts(CHAT) == ["one two three"]


async def test_stop_ends_a_stream_with_its_text_so_far(run: Run, hermes_home: Path) -> None:
    chats = EditingChats()
    agent = StreamingAgent(["part one", " and two"], hang=True)

    async def body(gateway: Gateway) -> None:
        await _say(gateway)
        await asyncio.wait_for(agent.hanging.wait(), 10)  # both chunks read, one shown
        await _say(gateway, "/stop", "502")

    await run(agent, chats, body)
    assert chats.messages[0].text == "part one and two"
    transcript, record, owed = _stored(hermes_home)
    assert transcript[-1] == {**transcript[-1], "role": "assistant", "content": "part one and two"}
    assert (record, owed) == (None, 0)


async def test_the_chat_sees_typing_until_the_reply_is_shown(run: Run) -> None:
    chats = EditingChats(typing_interval_secs=0.05)
    await run(StreamingAgent(["thinking done"], pause=0.3), chats, _say)
    assert chats.typing_calls >= 3
    calls = chats.typing_calls
    await asyncio.sleep(0.2)
    assert chats.typing_calls == calls


def _leave_stream(home: Path, owed: str | None, messages: int = 1) -> None:
    """A store as a process killed mid-stream leaves it, its posted messages ``m1``... (10
    characters each) named by the lane's stream record or, with ``owed`` (the finished reply
    stored and owed), by the reply's ledger row."""
    config = _config(home)
    layout = {"messages": [[f"m{n + 1}", 10 * n] for n in range(messages)]}
    with SessionStore(config.sessions_dir, config) as store:
        entry = store.get_or_create_session(telegram_dm(CHAT, user_id=CHAT))
        if owed is None:
            store.set_session_metadata(entry.session_key, STREAM_METADATA, layout)
        else:
            store._turns.record_delivery_obligation(
                entry.session_key, entry.session_id, "telegram", CHAT, None, owed, "501",
                reply_to_message_id="501", stream_messages=json.dumps(layout),
            )  # fmt: skip


async def test_a_stored_reply_is_edited_into_its_message_after_a_restart(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats()
    await chats.post(telegram_dm(CHAT), "the first half of")  # what the killed process showed
    _leave_stream(hermes_home, "the first half of the finished reply")

    async def idle(gateway: Gateway) -> None:
        return None

    await run(StreamingAgent([]), chats, idle)
    (message,) = chats.messages
    assert message.text == f"the first half of the finished reply\n\n{RECOVERED_NOTE}"
    _, record, owed = _stored(hermes_home)
    assert (record, owed) == (None, 0)


async def test_a_cut_stream_without_a_stored_reply_is_marked_before_the_next_turn(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats()
    await chats.post(telegram_dm(CHAT), "the first half of")
    _leave_stream(hermes_home, None)
    await run(StreamingAgent(["a new answer"]), chats, _say)
    assert chats.texts(CHAT) == [INTERRUPTED_NOTE, "a new answer"]
    _, record, owed = _stored(hermes_home)
    assert (record, owed) == (None, 0)


async def test_every_message_of_a_cut_stream_is_cleared_before_the_next_turn(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats()
    await chats.post(telegram_dm(CHAT), "the first ")
    await chats.post(telegram_dm(CHAT), "half of")
    _leave_stream(hermes_home, None, messages=2)
    await run(StreamingAgent(["a new answer"]), chats, _say)
    assert chats.texts(CHAT) == [INTERRUPTED_NOTE, CUT_PART, "a new answer"]


async def test_a_stored_reply_spanning_messages_is_edited_into_them_after_a_restart(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats(message_limit=12)
    await chats.post(telegram_dm(CHAT), "0123456789")
    await chats.post(telegram_dm(CHAT), "abc")
    _leave_stream(hermes_home, "0123456789abcdefghij", messages=2)

    async def idle(gateway: Gateway) -> None:
        return None

    await run(StreamingAgent([]), chats, idle)
    texts = chats.texts(CHAT)
    assert [text.strip() for text in texts[:2]] == ["0123456789", "abcdefghij"]
    assert "".join(texts[2:]).strip() == RECOVERED_NOTE  # past the limit: a message of its own
    assert all(len(text) <= 12 for text in texts[:2])


class _Chunks(Agent):
    """Streams what a test feeds it through a queue (None ends the reply)."""

    def __init__(self) -> None:
        self.feed: asyncio.Queue[str | None] = asyncio.Queue()

    async def run_turn(self, request: Any) -> AsyncIterator[str]:
        while (chunk := await self.feed.get()) is not None:
            yield chunk


async def test_nothing_is_shown_before_the_store_knows_the_stream(
    run: Run, hermes_home: Path
) -> None:
    chats = EditingChats()
    agent = _Chunks()
    seen: list[tuple[int, object]] = []

    async def body(gateway: Gateway) -> None:
        key = gateway.store.session_key_for(telegram_dm(CHAT, user_id=CHAT))

        def look() -> None:
            record = gateway.store.get_session_metadata(key, STREAM_METADATA)
            seen.append((len(chats.messages), record))

        await _say(gateway)
        for _ in range(200):  # the turn's start records the stream; the agent writes nothing yet
            if gateway.store.get_session_metadata(key, STREAM_METADATA) is not None:
                break
            await asyncio.sleep(0.01)
        look()
        await agent.feed.put("Hello there")
        for _ in range(200):
            if chats.messages:
                break
            await asyncio.sleep(0.01)
        look()
        await agent.feed.put(None)

    await run(agent, chats, body)
    assert seen == [(0, {"messages": []}), (1, {"messages": [["m1", 0]]})]
    _, record, owed = _stored(hermes_home)
    assert (record, owed) == (None, 0)  # the turn's end dropped it
