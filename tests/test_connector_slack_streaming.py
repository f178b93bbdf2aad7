"""Streamed replies through the Slack connector over real HTTP against the fake Web API, with a
real Gateway: one message grown with ``chat.update`` ending as the finished (escaped) reply, a
reply that escaping takes past 4,000 characters continued in a second message, a silence-only
stream posting only the silence notice, and no typing indicator (Slack has none for bots)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from support.connector_gateway import app_served, build_one, connector_serving
from support.fake_slack import (
    SECRET,
    TOKEN,
    Failure,
    FakeSlack,
    encode,
    message_event,
    signed_headers,
)
from support.loopback import LoopbackServer
from support.streaming import StreamingAgent

from hermes_core import EditingAdapter, GatewayConfig, SessionSource, TypingAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.testing import fresh_plugin_manager
from hermes_core.turns.ledger import SILENCE_NOTICE
from hermes_plugins.connectors.slack import SlackConnector
from hermes_plugins.connectors.slack_api import MESSAGE_LIMIT, escape_mrkdwn

SECRETS = {"SLACK_BOT_TOKEN": TOKEN, "SLACK_SIGNING_SECRET": SECRET}


@pytest.fixture
def fake() -> Iterator[tuple[FakeSlack, str]]:
    """The fake Slack and its Web API's base URL."""
    slack = FakeSlack()
    with LoopbackServer(slack.app) as server:
        yield slack, f"{server.url}/api"


@asynccontextmanager
async def running(
    home: Path, api_base: str, agent: StreamingAgent
) -> AsyncIterator[tuple[SlackConnector, httpx.AsyncClient, Gateway]]:
    """The gateway (edits as often as chunks come) and the Slack connector as ``serve`` builds
    them, the app on 127.0.0.1, and a client for it."""
    config = GatewayConfig.from_dict(
        {"platforms": {"slack": {"enabled": True, "api_base": api_base}},
         "streaming": {"edit_interval_secs": 0}},
        environ={"HERMES_HOME": str(home)},
    )  # fmt: skip
    plugins = fresh_plugin_manager(home)
    connector = build_one(config, plugins, SECRETS, SlackConnector)
    async with (
        connector_serving(config, plugins, connector, lambda: agent) as gateway,
        app_served(gateway, connector, config) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        yield connector, client, gateway


async def _converse(home: Path, api: str, agent: StreamingAgent) -> None:
    """One channel message answered to the end (the turn finished, its reply settled)."""
    async with running(home, api, agent) as (_, client, gateway):
        body = encode(message_event("hi", "1700000000.000100"))
        answer = await client.post("/slack", content=body, headers=signed_headers(body))
        assert answer.status_code == 200
        await gateway.idle()


async def test_a_streamed_reply_is_one_message_updated_into_the_finished_text(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    agent = StreamingAgent(["Fish", " & chips", " <today>", " at noon."], pause=0.05)
    await _converse(hermes_home, api, agent)
    (message,) = slack.posted
    assert message.text == escape_mrkdwn("Fish & chips <today> at noon.")
    assert len(slack.updates) >= 2  # it grew in place
    assert {(channel, ts) for channel, ts, _ in slack.updates} == {("C0GENERAL", message.ts)}


async def test_a_stream_escaping_takes_past_the_limit_continues_in_a_second_message(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    chunks = ["a<b & c>d. "] * 249 + ["done."]  # 2,744 characters, 4,488 once escaped
    await _converse(hermes_home, api, StreamingAgent(chunks, pause=0.001))
    texts = slack.texts
    assert len(texts) == 2
    assert all(len(text) <= MESSAGE_LIMIT for text in texts)
    assert "".join(texts) == escape_mrkdwn("".join(chunks))


async def test_a_silence_only_stream_posts_only_the_silence_notice(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    await _converse(hermes_home, api, StreamingAgent(["[SIL", "ENT", "]"]))
    assert slack.texts == [escape_mrkdwn(SILENCE_NOTICE)]
    assert slack.updates == []


async def test_the_adapter_edits_but_shows_no_typing(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    async with running(hermes_home, api, StreamingAgent([])) as (connector, _, _gateway):
        adapter = connector.adapter
        assert isinstance(adapter, EditingAdapter)
        assert not isinstance(adapter, TypingAdapter)
        assert adapter.measure("a&b") == len("a&amp;b")
        channel = SessionSource(platform="slack", chat_id="C0GENERAL", chat_type="group")
        posted = await adapter.post(channel, "x < y")
        assert posted.result.ok
        assert posted.message_id == slack.posted[0].ts
        assert (await adapter.edit(channel, posted.message_id, "x > y")).ok
        assert slack.texts == ["x &gt; y"]
        slack.fail_next(Failure("ratelimited", status=429, retry_after=2))
        limited = await adapter.edit(channel, posted.message_id, "x = y")
        assert (limited.failure_kind, limited.retry_after) == ("rate_limited", 2.0)
        missing = await adapter.edit(channel, "1.000000", "x = y")
        assert (missing.failure_kind, missing.error) == ("rejected", "message_not_found")
