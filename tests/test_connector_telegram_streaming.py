"""Streamed replies through the Telegram connector over real HTTP against the fake Bot API, with
a real Gateway: one message edited in place with ``editMessageText`` ending as the finished
reply, a reply past 4,096 UTF-16 units continued in a second message, a silence-only stream
posting only the silence notice, ``typing`` while the agent thinks, and the adapter's edits
(an unchanged text is a success, refusals mapped as a send's)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from support.connector_gateway import build_one, connector_serving, until
from support.fake_telegram import TOKEN, FakeTelegram, message_update
from support.loopback import LoopbackServer
from support.streaming import StreamingAgent

from hermes_core import (
    Agent,
    EditingAdapter,
    Gateway,
    GatewayConfig,
    SessionSource,
    TurnRequest,
    TypingAdapter,
    create_plugin_manager,
)
from hermes_core.domain.splitting import utf16_len
from hermes_core.turns.ledger import SILENCE_NOTICE
from hermes_plugins.connectors.telegram import TelegramConnector
from hermes_plugins.connectors.telegram_api import BotApi, TelegramAdapter


@pytest.fixture
def fake() -> Iterator[tuple[FakeTelegram, str]]:
    """The fake Bot API and its URL."""
    state = FakeTelegram()
    with LoopbackServer(state.app()) as server:
        yield state, server.url


@asynccontextmanager
async def serving(home: Path, url: str, agent: Agent) -> AsyncIterator[Gateway]:
    """A started gateway (edits as often as chunks come) with the Telegram connector in it."""
    config = GatewayConfig.from_dict(
        {"platforms": {"telegram": {"enabled": True, "api_base": url, "poll_timeout_secs": 1}},
         "streaming": {"edit_interval_secs": 0}},
        environ={"HERMES_HOME": str(home)},
    )  # fmt: skip
    plugins = create_plugin_manager(config, load_entrypoints=False, strict=True)
    connector = build_one(config, plugins, {"TELEGRAM_BOT_TOKEN": TOKEN}, TelegramConnector)
    async with connector_serving(config, plugins, connector, lambda: agent) as gateway:
        yield gateway


async def _converse(home: Path, url: str, state: FakeTelegram, agent: Agent) -> None:
    """One message from chat 42 answered to the end (the turn finished, its reply settled)."""
    async with serving(home, url, agent) as gateway:
        update = state.queue(message_update(42, "hi", message_id=8))
        await until(lambda: any((offset or 0) > update for offset in state.offsets))
        await gateway.idle()


async def test_a_streamed_reply_is_one_message_edited_into_the_finished_text(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    agent = StreamingAgent(["Hello", " wor", "ld, how", " are you?"], pause=0.05)
    await _converse(hermes_home, url, state, agent)
    (sent,) = state.sent
    assert (sent.chat_id, sent.reply_to, sent.text) == ("42", 8, "Hello")
    assert state.texts_now[sent.message_id] == "Hello world, how are you?"
    assert len(state.edits) >= 2  # it grew in place


async def test_a_stream_past_4096_utf16_units_continues_in_a_second_message(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    chunks = ["😀" * 40 + " "] * 59 + ["done."]  # 2,464 characters, 4,884 UTF-16 units
    await _converse(hermes_home, url, state, StreamingAgent(chunks, pause=0.001))
    texts = [state.texts_now[sent.message_id] for sent in state.sent]
    assert len(texts) == 2
    assert all(utf16_len(text) <= 4096 for text in texts)
    assert "".join(texts) == "".join(chunks)
    assert [sent.reply_to for sent in state.sent] == [8, None]


async def test_a_silence_only_stream_posts_only_the_silence_notice(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    await _converse(hermes_home, url, state, StreamingAgent(["[SIL", "ENT", "]"]))
    assert state.texts() == [SILENCE_NOTICE]
    assert state.edits == []


class ThinkingAgent(Agent):
    """Yields its reply only once the chat was shown that the bot is typing."""

    def __init__(self, state: FakeTelegram) -> None:
        self.state = state
        self.typing_seen = False

    async def run_turn(self, request: TurnRequest) -> AsyncIterator[str]:
        await until(lambda: bool(self.state.actions))
        self.typing_seen = True
        yield "Thought it over."


async def test_typing_is_shown_in_the_topic_while_the_agent_thinks(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    agent = ThinkingAgent(state)
    async with serving(hermes_home, url, agent) as gateway:
        state.queue(message_update(-1001, "think", message_id=9, thread_id=5))
        await until(lambda: bool(state.sent))
        await gateway.idle()
    assert agent.typing_seen
    assert state.actions[0] == ("-1001", "5", "typing")
    assert [(sent.thread_id, sent.text) for sent in state.sent] == [("5", "Thought it over.")]


def _adapter(url: str, parse_mode: str | None = None) -> TelegramAdapter:
    return TelegramAdapter(BotApi(url, TOKEN), parse_mode=parse_mode, connected=True)


def _chat(thread_id: str | None = None) -> SessionSource:
    return SessionSource(platform="telegram", chat_id="-1001", chat_type="group",
                         thread_id=thread_id)  # fmt: skip


async def test_the_adapter_edits_and_shows_typing(fake: tuple[FakeTelegram, str]) -> None:
    state, url = fake
    adapter = _adapter(url)
    assert isinstance(adapter, EditingAdapter)
    assert isinstance(adapter, TypingAdapter)
    assert (adapter.message_limit, adapter.measure("a😀")) == (4096, 3)
    try:
        await adapter.typing(_chat("1"))  # the General topic is named by no thread id
        assert state.actions == [("-1001", None, "typing")]
        posted = await adapter.post(_chat(), "first")
        assert posted.result.ok
        assert posted.message_id is not None
        message_id = int(posted.message_id)
        assert (await adapter.edit(_chat(), posted.message_id, "second")).ok
        unchanged = await adapter.edit(_chat(), posted.message_id, "second")
        assert unchanged.ok
        assert state.unchanged_edits == 1
        assert state.texts_now[message_id] == "second"
        state.refuse_next(429, "Too Many Requests: retry after 3", retry_after=3)
        limited = await adapter.edit(_chat(), posted.message_id, "third")
        assert (limited.failure_kind, limited.retry_after) == ("rate_limited", 3.0)
        state.refuse_next(403, "Forbidden: bot was kicked from the supergroup chat")
        assert (await adapter.edit(_chat(), posted.message_id, "third")).failure_kind == (
            "permanent"
        )
        assert (await adapter.edit(_chat(), "not-an-id", "third")).failure_kind == "rejected"
        assert state.edits == [(message_id, "second")]
    finally:
        await adapter.api.close()


async def test_an_edit_telegram_cannot_parse_is_made_in_plain_text(
    fake: tuple[FakeTelegram, str],
) -> None:
    state, url = fake
    state.refuse_entities = True
    adapter = _adapter(url, parse_mode="MarkdownV2")
    try:
        posted = await adapter.post(_chat(), "*bold")
        assert posted.message_id is not None
        assert (await adapter.edit(_chat(), posted.message_id, "*bolder")).ok
        assert state.texts_now[int(posted.message_id)] == "*bolder"
    finally:
        await adapter.api.close()


async def test_a_typing_indicator_that_gets_no_answer_is_not_raised() -> None:
    adapter = _adapter("http://127.0.0.1:9")  # the discard port: nothing listens
    try:
        await adapter.typing(_chat())
    finally:
        await adapter.api.close()
