"""The Slack connector over real HTTP on 127.0.0.1: signed Events API requests (the signature
computed as Slack documents it) to the served app, ``chat.postMessage`` to a fake Slack, through
a real Gateway on SQLite with the echo agent."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import yaml
from support.connector_gateway import app_served, build_one, connector_serving, until
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

from hermes_core import ConfigError, ConnectorContext, GatewayConfig, read_event
from hermes_core.domain.connectors import WebRequest
from hermes_core.gateway.agents import EchoAgent
from hermes_core.gateway.runtime import Gateway
from hermes_core.gateway.texts import REFUSED_NOT_SAVED
from hermes_core.testing import fresh_plugin_manager
from hermes_plugins.connectors.slack import SlackConnector, SlackSettings, build
from hermes_plugins.connectors.slack_api import MESSAGE_LIMIT, escape_mrkdwn, post_failure

SECRETS = {"SLACK_BOT_TOKEN": TOKEN, "SLACK_SIGNING_SECRET": SECRET}


@pytest.fixture
def fake() -> Iterator[tuple[FakeSlack, str]]:
    """The fake Slack and its Web API's base URL."""
    slack = FakeSlack()
    with LoopbackServer(slack.app) as server:
        yield slack, f"{server.url}/api"


def _context(home: Path, section: dict[str, Any], environ: dict[str, str]) -> ConnectorContext:
    config = GatewayConfig.from_dict(
        {"platforms": {"slack": {"enabled": True, **section}}},
        environ={"HERMES_HOME": str(home)},
    )
    plugins = fresh_plugin_manager(home)
    return ConnectorContext(
        platform="slack", settings=config.platforms["slack"].model_extra or {}, config=config,
        environ=environ, read_event=lambda payload: read_event("slack", payload, plugins=plugins),
    )  # fmt: skip


@dataclass
class Running:
    connector: SlackConnector
    gateway: Gateway
    client: httpx.AsyncClient

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """Slack's request to the app's route over HTTP: (status, body)."""
        answer = await self.client.post("/slack", content=body, headers=headers)
        return answer.status_code, answer.content

    async def deliver(self, body: dict[str, Any], **signing: Any) -> tuple[int, bytes]:
        """``body`` signed as Slack signs it."""
        raw = encode(body)
        return await self.post(raw, signed_headers(raw, **signing))


@asynccontextmanager
async def running(
    home: Path, api_base: str, settings: dict[str, Any] | None = None, think: float = 0.0
) -> AsyncIterator[Running]:
    """The gateway and the Slack connector as ``serve`` builds them, the app on 127.0.0.1."""
    config = GatewayConfig.from_dict(
        {"platforms": {"slack": {"enabled": True, "api_base": api_base}}, **(settings or {})},
        environ={"HERMES_HOME": str(home)},
    )
    plugins = fresh_plugin_manager(home)
    connector = build_one(config, plugins, SECRETS, SlackConnector)
    async with (
        connector_serving(config, plugins, connector, lambda: EchoAgent(think)) as gateway,
        app_served(gateway, connector, config) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        yield Running(connector, gateway, client)


async def test_a_channel_message_is_answered_in_the_channel(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    async with running(hermes_home, api) as bot:
        assert await bot.deliver(message_event("hello", "1700000000.000100")) == (200, b"stored")
        await until(lambda: len(slack.posted) == 1)
        reply = slack.posted[0]
        assert (reply.channel, reply.thread_ts, reply.text) == ("C0GENERAL", None, "echo: hello")
        assert "as @hermes in Fake Team" in bot.connector.status()


async def test_slack_is_answered_before_the_turn_runs(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    async with running(hermes_home, api, think=3.0) as bot:  # the agent takes Slack's 3 s
        started = time.monotonic()
        assert await bot.deliver(message_event("slow one", "1700000000.000150")) == (200, b"stored")
        assert time.monotonic() - started < 1.0
        assert slack.posted == []
        await until(lambda: len(slack.posted) == 1)
    assert slack.texts == ["echo: slow one"]


async def test_a_thread_message_is_answered_in_its_thread(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    async with running(hermes_home, api) as bot:
        event = message_event("in thread", "1700000050.000200", thread_ts="1700000000.000100")
        assert (await bot.deliver(event))[0] == 200
        await until(lambda: len(slack.posted) == 1)
        assert slack.posted[0].thread_ts == "1700000000.000100"
        assert slack.posted[0].text == "echo: [U0ANA] in thread"  # a shared lane: sender named


async def test_the_url_verification_challenge_is_answered_once_signed(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    api = fake[1]
    challenge = {"token": "t", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
                 "type": "url_verification"}  # fmt: skip
    async with running(hermes_home, api) as bot:
        assert await bot.deliver(challenge) == (200, challenge["challenge"].encode())
        assert (await bot.post(encode(challenge), {"Content-Type": "application/json"}))[0] == 401


async def test_forged_replayed_and_unsigned_requests_are_refused_and_store_nothing(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    body = encode(message_event("let me in", "1700000000.000300"))
    good = signed_headers(body)
    six_minutes_ago = int(time.time()) - 360
    refused = [
        signed_headers(body, secret="not-the-secret"),
        signed_headers(body, timestamp=six_minutes_ago),  # a genuine request replayed late
        signed_headers(body, timestamp=int(time.time()) + 360),
        {"Content-Type": "application/json"},
        {**good, "X-Slack-Signature": ""},
        {k: v for k, v in good.items() if k != "X-Slack-Request-Timestamp"},
        {**good, "X-Slack-Signature": good["X-Slack-Signature"].replace("v0=", "v1=")},
        {**good, "X-Slack-Request-Timestamp": "soon"},
    ]
    async with running(hermes_home, api) as bot:
        for headers in refused:
            assert await bot.post(body, headers) == (401, b"the request is not signed by Slack")
        assert (await bot.post(body + b" ", good))[0] == 401  # the body changed after signing
        await bot.gateway.idle()
        assert bot.gateway.store.list_sessions() == []
        assert slack.posted == []


async def test_a_redelivery_is_answered_once(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    event = message_event("only once", "1700000000.000400")
    async with running(hermes_home, api) as bot:
        assert (await bot.deliver(event))[0] == 200
        assert (await bot.deliver(event, retry=1))[0] == 200
        await until(lambda: len(slack.posted) >= 1)
        await bot.gateway.idle()
        await asyncio.sleep(0.3)
        assert slack.texts == ["echo: only once"]


async def test_a_long_reply_is_split_and_escaped(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    sentence = "Is 1 < 2 & 3 > 2? Yes. "
    text = sentence * 400  # 9,200 characters, 13,200 once escaped: four messages
    async with running(hermes_home, api) as bot:
        assert (await bot.deliver(message_event(text, "1700000000.000500")))[0] == 200
        await until(lambda: len(slack.posted) == 4)
        await bot.gateway.idle()
    assert all(len(part) <= MESSAGE_LIMIT for part in slack.texts)
    assert " ".join(slack.texts) == escape_mrkdwn(f"echo: {text}".strip())
    assert "&lt;" in slack.texts[0]
    assert "<" not in "".join(slack.texts)


async def test_mrkdwn_control_characters_are_escaped(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    async with running(hermes_home, api) as bot:
        await bot.deliver(message_event("<!channel> Q&A <https://x.test|here>", "1700000000.0006"))
        await until(lambda: len(slack.posted) == 1)
    assert slack.texts == ["echo: &lt;!channel&gt; Q&amp;A &lt;https://x.test|here&gt;"]


async def test_a_rate_limit_is_waited_out_and_the_reply_delivered_once(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    slack.fail_next(Failure("ratelimited", status=429, retry_after=1))
    async with running(hermes_home, api) as bot:
        await bot.deliver(message_event("busy day", "1700000000.000700"))
        await until(lambda: len(slack.posted) == 1, secs=15)
        await bot.gateway.idle()
        await asyncio.sleep(0.3)
    posts = [at for method, at in slack.calls if method == "chat.postMessage"]
    assert len(posts) == 2
    assert posts[1] - posts[0] >= 0.9
    assert len(slack.posted) == 1
    assert slack.texts[0].endswith("echo: busy day")


async def test_a_permanent_refusal_is_not_sent_again(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    slack.fail_next(Failure("channel_not_found"))
    async with running(hermes_home, api) as bot:
        await bot.deliver(message_event("anyone?", "1700000000.000800"))
        await until(lambda: any(method == "chat.postMessage" for method, _ in slack.calls))
        await bot.gateway.idle()
        await asyncio.sleep(1.5)
    assert [method for method, _ in slack.calls].count("chat.postMessage") == 1
    assert slack.posted == []


async def test_a_slash_command_is_acknowledged_empty_and_answered_in_its_channel(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    form = {"command": "/ask", "text": "what is due", "channel_id": "C0GENERAL",
            "channel_name": "general", "user_id": "U0ANA", "user_name": "ana",
            "team_id": "T0FAKE", "response_url": "https://hooks.slack.test/commands/1",
            "trigger_id": "1.2.3"}  # fmt: skip
    body = urlencode(form).encode()
    async with running(hermes_home, api) as bot:
        content_type = "application/x-www-form-urlencoded"
        headers = signed_headers(body, content_type=content_type)
        assert await bot.post(body, headers) == (200, b"")
        await until(lambda: len(slack.posted) == 1)
    assert slack.posted[0].channel == "C0GENERAL"
    assert slack.texts == ["echo: /ask what is due"]


async def test_an_event_the_store_cannot_take_gets_a_5xx_and_is_answered_when_retried(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    event = message_event("are you there", "1700000000.001000")
    quick = {"storage": {"sqlite_busy_timeout_secs": 0.3}}
    async with running(hermes_home, api, quick) as bot:
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            assert (await bot.deliver(event))[0] == 503
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert (await bot.deliver(event, retry=1))[0] == 200  # Slack delivers it again
        await until(lambda: "echo: are you there" in slack.texts)
        await bot.gateway.idle()
        await asyncio.sleep(0.2)
    assert slack.texts == [REFUSED_NOT_SAVED, "echo: are you there"]


async def test_events_before_start_get_a_5xx(hermes_home: Path) -> None:
    connector = build(_context(hermes_home, {}, SECRETS))
    raw = encode(message_event("too early", "1700000000.000900"))
    request = WebRequest("POST", "/slack", {k.lower(): v for k, v in signed_headers(raw).items()},
                         {}, raw)  # fmt: skip
    assert (await connector.handle(request)).status == 503


async def test_a_refused_token_stops_the_start_with_one_sentence(
    hermes_home: Path, fake: tuple[FakeSlack, str]
) -> None:
    slack, api = fake
    slack.auth_error = "invalid_auth"
    connector = build(_context(hermes_home, {"api_base": api}, SECRETS))
    with pytest.raises(
        ConfigError, match=r"Slack refused the bot token \(invalid_auth\)"
    ) as caught:
        await connector.start(fresh_plugin_manager(hermes_home))  # type: ignore[arg-type]
    assert caught.value.key == "platforms.slack.token_env"
    assert TOKEN not in str(caught.value)
    assert not connector.adapter.is_connected()


def test_missing_secrets_and_bad_settings_name_their_key(hermes_home: Path) -> None:
    with pytest.raises(ConfigError, match="SLACK_SIGNING_SECRET, which is not set") as caught:
        build(_context(hermes_home, {}, {"SLACK_BOT_TOKEN": TOKEN}))
    assert caught.value.key == "platforms.slack.signing_secret_env"
    with pytest.raises(ConfigError, match=r"platforms\.slack\.webhook_path") as caught:
        build(_context(hermes_home, {"webhook_path": "slack"}, SECRETS))


@pytest.mark.parametrize(
    ("status", "answer", "kind"),
    [
        (200, {"ok": True}, None),
        (200, {"ok": False, "error": "not_in_channel"}, "permanent"),
        (200, {"ok": False, "error": "is_archived"}, "permanent"),
        (200, {"ok": False, "error": "token_revoked"}, "permanent"),
        (200, {"ok": False, "error": "ratelimited"}, "rate_limited"),
        (200, {"ok": False, "error": "msg_too_long"}, "rejected"),
        (429, {"ok": False, "error": "ratelimited"}, "rate_limited"),
        (503, {}, "disconnected"),
    ],
)
def test_slack_answers_map_to_the_ledgers_failure_kinds(
    status: int, answer: dict[str, Any], kind: str | None
) -> None:
    response = httpx.Response(status, json=answer, headers={"Retry-After": "7"})
    failure = post_failure(response)
    assert (failure.failure_kind if failure else None) == kind
    if kind == "rate_limited":
        assert failure is not None
        assert failure.retry_after == 7


def test_the_documented_settings_are_every_key_with_its_default() -> None:
    document = Path(__file__).resolve().parents[1] / "docs" / "connectors.md"
    section = document.read_text(encoding="utf-8").split("\n## Slack\n", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    written = yaml.safe_load(block)["platforms"]["slack"]
    assert set(written) - {"enabled"} == set(SlackSettings.model_fields)
    assert SlackSettings.model_validate(written) == SlackSettings()
