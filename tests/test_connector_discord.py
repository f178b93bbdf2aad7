"""The Discord connector against a fake Discord on 127.0.0.1 (a real websocket gateway and REST
over HTTP), through a real Gateway on SQLite with the echo agent: messages answered in their
channel or thread, replies split, the gateway session surviving drops, reconnects, invalid
sessions and zombies, rate limits kept, and what came while nobody listened read back."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.connector_gateway import build_one, connector_serving, until
from support.fake_discord import (
    CHANNEL,
    CHANNELS,
    DM,
    GUILD,
    THREAD,
    TOKEN,
    USER,
    FakeDiscord,
    Limit,
    running,
)
from support.streaming import StreamingAgent

from hermes_core import ConfigError, GatewayConfig, SessionSource
from hermes_core.gateway.agents import Agent, EchoAgent, EditingAdapter, TypingAdapter
from hermes_core.gateway.runtime import Gateway
from hermes_core.gateway.texts import REFUSED_NOT_SAVED
from hermes_core.serve.runner import build_connectors
from hermes_core.testing import fresh_plugin_manager
from hermes_plugins.connectors.discord import DiscordConnector
from hermes_plugins.connectors.discord_rest import DiscordAdapter, DiscordRest

SECRETS = {"DISCORD_BOT_TOKEN": TOKEN}


@pytest.fixture
def fake() -> Iterator[tuple[FakeDiscord, str]]:
    """The fake Discord (heartbeats every 0.5 s) and its REST base URL."""
    with running(FakeDiscord(heartbeat_ms=500)) as served:
        yield served


def _config(
    home: Path, fake: FakeDiscord, api: str, settings: dict[str, Any] | None = None, **section: Any
) -> GatewayConfig:
    discord = {"enabled": True, "api_base": api, "gateway_url": fake.ws_url, **section}
    return GatewayConfig.from_dict(
        {"platforms": {"discord": discord}, **(settings or {})}, environ={"HERMES_HOME": str(home)}
    )


def _connector(home: Path, config: GatewayConfig) -> DiscordConnector:
    return build_one(config, fresh_plugin_manager(home), SECRETS, DiscordConnector)


@dataclass
class Running:
    connector: DiscordConnector
    gateway: Gateway


@asynccontextmanager
async def serving(
    home: Path,
    fake: FakeDiscord,
    api: str,
    agent: Callable[[], Agent] = EchoAgent,
    settings: dict[str, Any] | None = None,
) -> AsyncIterator[Running]:
    """The gateway and the Discord connector as ``serve`` builds them (``settings``: more
    sections of the configuration)."""
    config = _config(home, fake, api, settings)
    connector = _connector(home, config)
    async with connector_serving(config, fresh_plugin_manager(home), connector, agent) as gateway:
        yield Running(connector, gateway)


async def _settle(fake: FakeDiscord, answers: int) -> None:
    """Wait for ``answers`` replies, then a moment more for any that must not come."""
    await until(lambda: len(fake.posted) >= answers)
    await asyncio.sleep(0.5)


async def test_messages_are_answered_in_their_channel_thread_or_dm(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api) as bot:
        asked = [discord.say("in the channel"), discord.say("in the thread", THREAD),
                 discord.say("in private", DM)]  # fmt: skip
        await _settle(discord, 3)
        assert "as hermes" in bot.connector.status()
    assert [(p.channel, p.content, p.reply_to) for p in discord.posted] == [
        (CHANNEL, "echo: in the channel", asked[0]),
        (THREAD, "echo: [Ana] in the thread", asked[1]),  # a thread is shared
        (DM, "echo: in private", asked[2]),
    ]
    assert all(p.allowed_mentions == {"parse": []} for p in discord.posted)
    (identify,) = discord.identifies
    assert identify["intents"] == 1 | 1 << 9 | 1 << 12 | 1 << 15
    assert discord.heartbeats >= 1


async def test_a_reply_over_2000_characters_is_split(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    text = " ".join(f"word{n}" for n in range(500))  # about 3,900 characters
    async with serving(hermes_home, discord, api):
        asked = discord.say(text)
        await _settle(discord, 2)
    first, second = discord.posted
    assert len(first.content) <= 2000
    assert len(second.content) <= 2000
    assert (first.reply_to, second.reply_to) == (asked, None)
    assert f"{first.content} {second.content}".split() == f"echo: {text}".split()


async def test_a_dropped_connection_resumes_and_replays_what_was_dispatched_meanwhile(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        first = discord.say("before the drop")
        await until(lambda: len(discord.posted) == 1)
        discord.drop()
        meanwhile = [discord.say("while down 1"), discord.say("while down 2")]
        await _settle(discord, 3)
    assert len(discord.identifies) == 1
    assert [resume["session_id"] for resume in discord.resumes] == ["session-1"]
    for asked in [first, *meanwhile]:
        assert len(discord.answers_to(asked)) == 1
    assert len([text for text in discord.texts if text.startswith("echo:")]) == 3


async def test_reconnect_asked_by_discord_resumes(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        discord.reconnect()
        await until(lambda: len(discord.resumes) == 1)
        asked = discord.say("after the reconnect")
        await _settle(discord, 1)
    assert len(discord.identifies) == 1
    assert len(discord.answers_to(asked)) == 1


@pytest.mark.slow
async def test_close_codes_decide_between_resuming_and_a_new_session(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        discord.close(4000)  # an unknown error: resume
        await until(lambda: len(discord.resumes) == 1)
        discord.close(4009)  # the session timed out: identify again
        await until(lambda: len(discord.identifies) == 2)
        asked = discord.say("still here")
        await _settle(discord, 1)
    assert len(discord.resumes) == 1
    assert len(discord.answers_to(asked)) == 1


@pytest.mark.slow
async def test_an_invalid_session_identifies_again_and_reads_back_what_it_missed(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        first = discord.say("before")
        await until(lambda: len(discord.posted) == 1)
        discord.invalidate(resumable=False)
        missed = discord.say("never dispatched", dispatch=False)  # lost with the session
        await until(lambda: len(discord.identifies) == 2, secs=15.0)
        await _settle(discord, 2)
    assert discord.resumes == []
    assert len(discord.answers_to(first)) == 1
    assert len(discord.answers_to(missed)) == 1
    assert len(discord.posted) == 2


async def test_a_connection_without_heartbeat_acks_is_closed_and_resumed(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        discord.ack = False
        await until(lambda: len(discord.resumes) >= 1, secs=15.0)
        discord.ack = True
        asked = discord.say("after the zombie")
        await _settle(discord, 1)
    assert len(discord.identifies) == 1
    assert len(discord.answers_to(asked)) == 1


async def test_a_refused_token_or_intent_is_a_config_error(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    for code, key in ((4004, "token_env"), (4014, "intents")):
        discord.identify_close = code
        connector = _connector(hermes_home, _config(hermes_home, discord, api))
        gateway = Gateway(_config(hermes_home, discord, api), fresh_plugin_manager(hermes_home),
                          lambda entry: EchoAgent(), [connector.adapter])  # fmt: skip
        with pytest.raises(ConfigError, match=f"platforms.discord.{key}"):
            await connector.start(gateway)
    assert len(discord.identifies) == 2  # one each: no retry loop


async def test_the_gateway_is_found_with_get_gateway_bot_which_checks_the_token(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    config = _config(hermes_home, discord, api, gateway_url=None)
    plugins = fresh_plugin_manager(hermes_home)
    (refused,) = build_connectors(config, plugins, {"DISCORD_BOT_TOKEN": "not.the.token"})
    gateway = Gateway(config, plugins, lambda entry: EchoAgent(), [refused.adapter])
    with pytest.raises(ConfigError, match=r"platforms\.discord\.token_env"):
        await refused.start(gateway)
    assert discord.identifies == []
    connector = _connector(hermes_home, config)
    gateway = Gateway(config, plugins, lambda entry: EchoAgent(), [connector.adapter])
    async with gateway:
        await connector.start(gateway)
        try:
            asked = discord.say("found you")
            await _settle(discord, 1)
        finally:
            await connector.stop()
    assert len(discord.answers_to(asked)) == 1
    assert [call for call, _ in discord.calls].count("GET /api/v10/gateway/bot") == 2


def test_unknown_intents_are_refused_by_name(hermes_home: Path) -> None:
    fake = FakeDiscord(ws_url="ws://127.0.0.1:9")
    with pytest.raises(ConfigError, match="intents"):
        _connector(hermes_home, _config(hermes_home, fake, "http://x", intents=["GUILDS", "NOPE"]))
    numeric = _connector(hermes_home, _config(hermes_home, fake, "http://x", intents=513))
    assert numeric.settings.intent_bits() == 513


async def test_a_streamed_reply_is_one_message_edited_in_place(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    chunks = ["Streaming ", "into ", "Discord, ", "edited in place."]
    streaming = {"streaming": {"edit_interval_secs": 0.1}}
    async with serving(hermes_home, discord, api, lambda: StreamingAgent(chunks, pause=0.25),
                       streaming):  # fmt: skip
        asked = discord.say("stream to me")
        await until(lambda: discord.history[CHANNEL][-1]["content"] == "".join(chunks))
        await asyncio.sleep(0.5)
    (reply,) = discord.posted
    assert (reply.channel, reply.reply_to) == (CHANNEL, asked)
    assert len(discord.edits) >= 2
    assert {(channel, message) for channel, message, _ in discord.edits} == {(CHANNEL, reply.id)}
    assert discord.edits[-1][2] == "".join(chunks)
    assert CHANNEL in discord.typing


async def test_an_interaction_is_stored_then_acknowledged(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api):
        discord.dispatch("INTERACTION_CREATE", {
            "id": "900000000000000777", "application_id": "900000000000000098", "type": 2,
            "token": "interaction-token", "guild_id": GUILD, "channel_id": CHANNEL,
            "channel": CHANNELS[CHANNEL], "member": {"user": USER},
            "data": {"name": "ask", "options": [{"type": 3, "name": "q", "value": "what is due"}]},
        })  # fmt: skip
        await _settle(discord, 1)
    assert discord.callbacks == [("900000000000000777", {"type": 5})]
    assert discord.texts == ["echo: /ask what is due"]


async def test_a_message_the_store_cannot_take_is_read_back_once_it_can(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    storage = {"storage": {"sqlite_busy_timeout_secs": 0.3}}
    async with serving(hermes_home, discord, api, settings=storage) as bot:
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process holds the database
        try:
            asked = discord.say("is the disk back")
            await until(lambda: REFUSED_NOT_SAVED in discord.texts)
            assert int(bot.connector.seen.channels()[CHANNEL]) < int(asked)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        await until(lambda: "echo: is the disk back" in discord.texts)
        await asyncio.sleep(0.5)
        assert int(bot.connector.seen.channels()[CHANNEL]) >= int(asked)
    assert discord.texts.count("echo: is the disk back") == 1
    assert len(discord.answers_to(asked)) == 1


# -- the adapter over REST ------------------------------------------------------------------

SOURCE = SessionSource(platform="discord", chat_id=CHANNEL, chat_type="group", user_id="u")


@asynccontextmanager
async def adapter(api: str) -> AsyncIterator[DiscordAdapter]:
    rest = DiscordRest(api, TOKEN)
    try:
        yield DiscordAdapter(rest, connected=True)
    finally:
        await rest.close()


async def test_a_short_429_is_waited_and_a_long_one_handed_to_the_ledger(
    fake: tuple[FakeDiscord, str],
) -> None:
    discord, api = fake
    async with adapter(api) as discord_adapter:
        discord.limit_next(Limit(0.4))
        started = time.monotonic()
        assert (await discord_adapter.send(SOURCE, "after a wait")).ok
        assert time.monotonic() - started >= 0.4
        discord.limit_next(Limit(12.5))
        result = await discord_adapter.send(SOURCE, "later")
    assert (result.ok, result.failure_kind, result.retry_after) == (False, "rate_limited", 12.5)
    assert discord.texts == ["after a wait"]


async def test_a_global_429_holds_every_route(fake: tuple[FakeDiscord, str]) -> None:
    discord, api = fake
    async with adapter(api) as discord_adapter:
        discord.limit_next(Limit(0.6, global_=True))
        posting = asyncio.create_task(discord_adapter.send(SOURCE, "first"))
        await until(lambda: len(discord.calls) == 1)
        await asyncio.sleep(0.1)  # the 429 arrived
        started = time.monotonic()
        await discord_adapter.typing(SOURCE)  # another route, held by the global limit
        assert time.monotonic() - started >= 0.3
        assert (await posting).ok
    assert discord.texts == ["first"]
    assert discord.typing == [CHANNEL]


@pytest.mark.slow
async def test_an_exhausted_bucket_is_waited_for_before_sending(
    fake: tuple[FakeDiscord, str],
) -> None:
    discord, api = fake
    discord.bucket_size, discord.bucket_window = 2, 1.0
    async with adapter(api) as discord_adapter:
        started = time.monotonic()
        for n in range(5):
            assert (await discord_adapter.send(SOURCE, f"message {n}")).ok
    assert time.monotonic() - started >= 2.0 - 0.1
    assert discord.violations == 0
    assert discord.texts == [f"message {n}" for n in range(5)]


async def test_an_unknown_channel_is_permanent(fake: tuple[FakeDiscord, str]) -> None:
    _, api = fake
    gone = SessionSource(platform="discord", chat_id="12345678", chat_type="group", user_id="u")
    async with adapter(api) as discord_adapter:
        result = await discord_adapter.send(gone, "anyone?")
    assert (result.ok, result.failure_kind) == (False, "permanent")
    assert "Unknown Channel" in (result.error or "")


async def test_post_edit_and_typing_reach_discord(fake: tuple[FakeDiscord, str]) -> None:
    discord, api = fake
    in_thread = SessionSource(platform="discord", chat_id=CHANNEL, thread_id=THREAD,
                              chat_type="thread", user_id="u")  # fmt: skip
    async with adapter(api) as discord_adapter:
        assert isinstance(discord_adapter, EditingAdapter)
        assert isinstance(discord_adapter, TypingAdapter)
        assert discord_adapter.message_limit == 2000
        assert discord_adapter.measure("héllo") == 5
        posted = await discord_adapter.post(in_thread, "draft", reply_to="42")
        assert posted.result.ok
        assert posted.message_id == discord.posted[0].id
        assert (await discord_adapter.edit(in_thread, posted.message_id, "final")).ok
        missing = await discord_adapter.edit(in_thread, "999999", "nothing")
        await discord_adapter.typing(in_thread)
    assert discord.posted[0].channel == THREAD
    assert discord.posted[0].reply_to == "42"
    assert discord.edits == [(THREAD, posted.message_id, "final")]
    assert missing.failure_kind == "permanent"
    assert discord.typing == [THREAD]


async def test_the_last_seen_file_follows_what_was_stored(
    hermes_home: Path, fake: tuple[FakeDiscord, str]
) -> None:
    discord, api = fake
    async with serving(hermes_home, discord, api) as bot:
        asked = discord.say("remember me")
        await until(lambda: len(discord.posted) == 1)
        state = bot.connector.seen.path
    assert state == hermes_home / "discord" / "last_seen.json"
    seen = json.loads(state.read_text(encoding="utf-8"))
    assert int(seen[CHANNEL]) >= int(asked)
