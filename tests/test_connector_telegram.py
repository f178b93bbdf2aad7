"""The Telegram connector over real HTTP against a fake Bot API on the loopback interface: long
polling into a real Gateway (SQLite under the test's home, the echo agent), replies through
``sendMessage`` into the right chat and topic, split at 4,096 UTF-16 units, the plain-text
fallback, rate limits, permanent refusals, the webhook's secret token, and the offset that moves
past an update only once it is stored."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.connector_gateway import LongAgent, app_served, build_one, connector_serving, until
from support.fake_telegram import BOT_USERNAME, TOKEN, FakeTelegram, message_update
from support.loopback import LoopbackServer

from hermes_core import (
    Agent,
    EchoAgent,
    Gateway,
    GatewayConfig,
    HermesPluginManager,
    MessageEvent,
    SessionSource,
    create_plugin_manager,
)
from hermes_core.domain.errors import ConfigError, MessageNotStoredError
from hermes_core.domain.splitting import utf16_len
from hermes_plugins.connectors.telegram import ALLOWED_UPDATES, TelegramConnector

SECRET = "s3cret_token-for-tests"


@pytest.fixture
def fake() -> Iterator[tuple[FakeTelegram, str]]:
    """The fake Bot API and its URL."""
    state = FakeTelegram()
    with LoopbackServer(state.app()) as server:
        yield state, server.url


def _config(home: Path, api: str, public_url: str | None = None, **section: Any) -> GatewayConfig:
    settings = {"enabled": True, "api_base": api, "poll_timeout_secs": 1,
                "retry_max_secs": 0.2, **section}  # fmt: skip
    server = {"public_url": public_url} if public_url else {}
    return GatewayConfig.from_dict(
        {"platforms": {"telegram": settings}, "server": server},
        environ={"HERMES_HOME": str(home)},
    )


def _plugins(config: GatewayConfig) -> HermesPluginManager:
    return create_plugin_manager(config, load_entrypoints=False, strict=True)


def _build(config: GatewayConfig, **environ: str) -> TelegramConnector:
    """The connector as ``serve`` builds it."""
    secrets = {"TELEGRAM_BOT_TOKEN": TOKEN, **environ}
    return build_one(config, _plugins(config), secrets, TelegramConnector)


def serving(
    config: GatewayConfig, connector: TelegramConnector, agent: Agent | None = None
) -> AbstractAsyncContextManager[Gateway]:
    """A started gateway with the connector started into it (one ``agent`` for every session,
    else the echo agent)."""
    factory = EchoAgent if agent is None else lambda: agent
    return connector_serving(config, _plugins(config), connector, factory)


# -- long polling -------------------------------------------------------------------------------


async def test_an_update_is_answered_in_its_chat_and_topic(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _config(hermes_home, url)
    connector = _build(config)
    async with serving(config, connector):
        assert connector.status() == f"telegram: long polling {url} as @{BOT_USERNAME}"
        topic = state.queue(message_update(-1001, "in the topic", message_id=7, thread_id=5))
        direct = state.queue(message_update(42, "hello", message_id=8))
        await until(lambda: len(state.sent) == 2)
        await until(lambda: (state.offsets[-1] or 0) > direct)
    by_chat = {sent.chat_id: sent for sent in state.sent}
    assert by_chat["-1001"].thread_id == "5"
    assert by_chat["-1001"].reply_to == 7
    assert by_chat["-1001"].text == "echo: [Ana] in the topic"  # a shared topic names senders
    assert by_chat["42"].thread_id is None
    assert by_chat["42"].reply_to == 8
    assert by_chat["42"].parse_mode is None
    assert state.allowed_updates == list(ALLOWED_UPDATES)
    assert topic < direct
    assert state.pending == []  # the stopping poller confirmed what it stored


async def test_a_long_reply_is_split_at_4096_utf16_units(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    paragraph = "Emoji count twice in UTF-16 😀. " * 40
    text = "\n\n".join([paragraph.strip()] * 8)  # about 8,700 UTF-16 units
    config = _config(hermes_home, url)
    async with serving(config, _build(config), LongAgent(text)):
        state.queue(message_update(42, "tell me a lot", message_id=3))
        await until(lambda: len(state.sent) >= 3)
        await asyncio.sleep(0.2)
    assert len(state.sent) == 3
    assert all(utf16_len(sent.text) <= 4096 for sent in state.sent)
    assert "\n\n".join(sent.text for sent in state.sent) == text
    assert [sent.reply_to for sent in state.sent] == [3, None, None]


async def test_entities_telegram_cannot_parse_are_sent_as_plain_text(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    state.refuse_entities = True
    config = _config(hermes_home, url, parse_mode="MarkdownV2")
    async with serving(config, _build(config)):
        state.queue(message_update(42, "*unclosed", message_id=3))
        await until(lambda: len(state.sent) == 1)
    assert state.sent[0].text == "echo: *unclosed"
    assert state.sent[0].parse_mode is None
    assert state.attempts == 2


async def test_the_parse_mode_is_sent_when_telegram_accepts_it(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _config(hermes_home, url, parse_mode="HTML")
    async with serving(config, _build(config)):
        state.queue(message_update(42, "<b>bold</b>", message_id=3))
        await until(lambda: len(state.sent) == 1)
    assert state.sent[0].parse_mode == "HTML"


async def test_a_rate_limited_reply_is_sent_once_after_retry_after(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    state.refuse_next(429, "Too Many Requests: retry after 1", retry_after=1)
    config = _config(hermes_home, url)
    async with serving(config, _build(config)):
        started = time.monotonic()
        state.queue(message_update(42, "hi", message_id=3))
        await until(lambda: len(state.sent) == 1)
        waited = time.monotonic() - started
        await asyncio.sleep(0.3)
    assert waited >= 1.0
    [delivered] = state.texts()  # once; the ledger marks a reply it sends again as recovered
    assert delivered.endswith("echo: hi")
    assert state.attempts == 2


@pytest.mark.parametrize(
    ("status", "description"),
    [(403, "Forbidden: bot was blocked by the user"), (400, "Bad Request: chat not found")],
)
async def test_a_permanent_refusal_is_abandoned_without_retrying(
    fake: tuple[FakeTelegram, str], hermes_home: Path, status: int, description: str
) -> None:
    state, url = fake
    state.refuse_next(status, description)
    config = _config(hermes_home, url)
    async with serving(config, _build(config)) as gateway:
        state.queue(message_update(42, "hi", message_id=3))
        await until(lambda: state.attempts == 1)
        await gateway.idle()
        await asyncio.sleep(1.0)
    assert state.attempts == 1
    assert state.sent == []


async def test_the_general_topic_is_not_named_as_a_thread(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    adapter = _build(_config(hermes_home, url)).adapter
    general = SessionSource(platform="telegram", chat_id="-1001", chat_type="group", thread_id="1")
    result = await adapter.send(general, "to the General topic", reply_to="12")
    await adapter.api.close()
    assert result.ok
    assert state.sent[0].thread_id is None
    assert state.sent[0].reply_to == 12


async def test_a_button_press_is_answered_in_its_chat_replying_to_no_message(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _config(hermes_home, url)
    press = {"callback_query": {
        "id": "4382095830293847562", "data": "yes",
        "from": {"id": 42, "is_bot": False, "first_name": "Ana"},
        "message": message_update(42, "Continue?", message_id=30)["message"],
    }}  # fmt: skip
    async with serving(config, _build(config)):
        state.queue(press)
        await until(lambda: len(state.sent) == 1)
    assert state.sent[0].chat_id == "42"
    assert state.sent[0].reply_to is None
    assert state.sent[0].text == "echo: yes"
    assert state.answered_queries == ["4382095830293847562"]  # the client stops waiting


async def test_a_reply_to_a_group_that_became_a_supergroup_goes_to_the_supergroup(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    state.migrated["-4001"] = -1004001
    adapter = _build(_config(hermes_home, url)).adapter
    group = SessionSource(platform="telegram", chat_id="-4001", chat_type="group")
    result = await adapter.send(group, "after the upgrade", reply_to="3")
    await adapter.api.close()
    assert result.ok
    assert [(sent.chat_id, sent.text) for sent in state.sent] == [("-1004001", "after the upgrade")]


class RefusingInbox:
    """Refuses to store the event with text ``refused`` ``times`` times, then records it."""

    def __init__(self, refused: str = "", times: int = 0) -> None:
        self.refused = refused
        self.times = times
        self.stored: list[MessageEvent] = []
        self.offered = 0

    async def handle_message(self, event: MessageEvent) -> None:
        self.offered += 1
        if event.text == self.refused and self.times:
            self.times -= 1
            raise MessageNotStoredError("the store is unavailable")
        self.stored.append(event)

    async def platform_connected(self, platform: str) -> None:
        return


async def test_the_offset_moves_past_an_update_only_once_it_is_stored(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    connector = _build(_config(hermes_home, url))
    inbox = RefusingInbox("second", times=3)
    first = state.queue(message_update(42, "first", message_id=1))
    second = state.queue(message_update(42, "second", message_id=2))
    await connector.start(inbox)
    try:
        await until(lambda: "not stored" in connector.status())
        await until(lambda: len(inbox.stored) == 2)
        await until(lambda: (state.offsets[-1] or 0) > second)
    finally:
        await connector.stop()
    assert inbox.offered == 5
    assert [event.text for event in inbox.stored] == ["first", "second"]
    # Past the first update at once; then from the refused one, never past it, until stored.
    asked = [offset for offset in state.offsets if offset is not None and offset <= second]
    assert asked[0] == second == first + 1
    assert set(asked) == {second}
    assert len(asked) >= 3
    assert "not stored" not in connector.status()


async def test_a_refused_token_is_a_config_error_at_start(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    _, url = fake
    connector = _build(_config(hermes_home, url), TELEGRAM_BOT_TOKEN="999:wrong")
    with pytest.raises(ConfigError, match="refused the bot token in TELEGRAM_BOT_TOKEN") as caught:
        await connector.start(RefusingInbox())
    assert caught.value.key == "platforms.telegram.token_env"
    assert "wrong" not in str(caught.value)
    await connector.stop()


async def test_an_unreachable_bot_api_at_start_is_a_warning_and_the_poller_keeps_trying(
    hermes_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as closed:  # a port of this machine on which nothing listens
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    connector = _build(_config(hermes_home, url))
    await connector.start(RefusingInbox())
    try:
        assert "did not answer getMe at start" in caplog.text
        await until(lambda: "cannot be reached (ConnectError); trying again" in connector.status())
    finally:
        await connector.stop()


async def test_polling_is_refused_while_a_webhook_is_set(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    state.webhook = {"url": "https://example.org/telegram"}
    connector = _build(_config(hermes_home, url))
    with pytest.raises(ConfigError, match="deleteWebhook"):
        await connector.start(RefusingInbox())
    await connector.stop()


async def test_a_conflicting_poller_is_reported_in_the_status(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    connector = _build(_config(hermes_home, url))
    await connector.start(RefusingInbox())
    try:
        state.webhook = {"url": "https://example.org/telegram"}  # getUpdates now answers 409
        await until(lambda: "another poller or a webhook" in connector.status())
    finally:
        await connector.stop()


# -- webhook ------------------------------------------------------------------------------------


@asynccontextmanager
async def webhook_app(
    config: GatewayConfig, connector: TelegramConnector
) -> AsyncIterator[tuple[Gateway, str]]:
    """The gateway with the connector started, and the URL of its webhook route served by the
    HTTP app over real HTTP."""
    async with serving(config, connector) as gateway, app_served(gateway, connector, config) as url:
        yield gateway, url + connector.settings.webhook_path


async def _post(url: str, body: bytes, secret: str | None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if secret is not None:
        headers["X-Telegram-Bot-Api-Secret-Token"] = secret
    async with httpx.AsyncClient() as client:
        return await client.post(url, content=body, headers=headers)


async def test_a_webhook_update_with_the_secret_is_stored_and_answered(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    state, url = fake
    config = _config(hermes_home, url, "https://bot.example.org/", mode="webhook")
    connector = _build(config, TELEGRAM_WEBHOOK_SECRET=SECRET)
    async with webhook_app(config, connector) as (gateway, hook):
        assert state.webhook["url"] == "https://bot.example.org/telegram"
        assert state.webhook["secret_token"] == SECRET
        assert state.webhook["allowed_updates"] == list(ALLOWED_UPDATES)
        assert "registered with setWebhook" in connector.status()
        update = {"update_id": 5, **message_update(42, "hook", message_id=9)}
        answer = await _post(hook, json.dumps(update).encode(), SECRET)
        assert (answer.status_code, answer.text) == (200, "stored")
        await until(lambda: len(state.sent) == 1)
        assert len(gateway.store.list_sessions()) == 1
        press = {"update_id": 6, "callback_query": {
            "id": "5382095830293847562", "data": "go",
            "from": {"id": 42, "is_bot": False, "first_name": "Ana"},
            "message": message_update(42, "Continue?", message_id=30)["message"],
        }}  # fmt: skip
        answer = await _post(hook, json.dumps(press).encode(), SECRET)
        assert (answer.status_code, answer.text) == (200, "stored")
        await until(lambda: len(state.sent) == 2)
        await until(lambda: state.answered_queries == ["5382095830293847562"])
    assert state.sent[0].text == "echo: hook"
    assert state.sent[0].reply_to == 9
    assert state.offsets == []  # a webhook bot never polls


@pytest.mark.parametrize("secret", [None, b"", b"wrong", SECRET.encode() + b"x", b"\xe9"])
async def test_a_webhook_post_without_the_secret_is_refused_and_stores_nothing(
    fake: tuple[FakeTelegram, str], hermes_home: Path, secret: bytes | None
) -> None:
    state, url = fake
    config = _config(hermes_home, url, mode="webhook")
    connector = _build(config, TELEGRAM_WEBHOOK_SECRET=SECRET)
    async with webhook_app(config, connector) as (gateway, hook):
        assert "call setWebhook" in connector.status()
        assert state.webhook == {}
        update = {"update_id": 5, **message_update(42, "forged", message_id=9)}
        body = json.dumps(update).encode()
        headers = {} if secret is None else {b"X-Telegram-Bot-Api-Secret-Token": secret}
        async with httpx.AsyncClient() as client:
            answer = await client.post(hook, content=body, headers=headers)
        assert answer.status_code == 401
        assert SECRET not in answer.text
        await gateway.idle()
        assert gateway.store.list_sessions() == []
    assert state.attempts == 0


async def test_a_webhook_body_that_is_not_json_is_a_400(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    _, url = fake
    config = _config(hermes_home, url, mode="webhook")
    connector = _build(config, TELEGRAM_WEBHOOK_SECRET=SECRET)
    async with webhook_app(config, connector) as (gateway, hook):
        answer = await _post(hook, b"{not json", SECRET)
        assert answer.status_code == 400
        await gateway.idle()
        assert gateway.store.list_sessions() == []


async def test_a_stopped_webhook_answers_503_so_that_telegram_delivers_again(
    fake: tuple[FakeTelegram, str], hermes_home: Path
) -> None:
    _, url = fake
    config = _config(hermes_home, url, mode="webhook")
    connector = _build(config, TELEGRAM_WEBHOOK_SECRET=SECRET)
    async with webhook_app(config, connector) as (gateway, hook):
        await connector.stop()
        update = {"update_id": 5, **message_update(42, "late", message_id=9)}
        answer = await _post(hook, json.dumps(update).encode(), SECRET)
        assert answer.status_code == 503
        await gateway.idle()
        assert gateway.store.list_sessions() == []


def test_webhook_mode_needs_a_usable_secret(hermes_home: Path) -> None:
    config = _config(hermes_home, "http://127.0.0.1:9", mode="webhook")
    with pytest.raises(ConfigError, match="TELEGRAM_WEBHOOK_SECRET") as caught:
        _build(config)
    assert caught.value.key == "platforms.telegram.webhook_secret_env"
    with pytest.raises(ConfigError, match="letters, digits"):
        _build(config, TELEGRAM_WEBHOOK_SECRET="has spaces")


def test_the_documented_examples_are_valid_settings(hermes_home: Path) -> None:
    """The Telegram section's YAML examples load, and the connector accepts their keys."""
    document = (Path(__file__).parents[1] / "docs" / "connectors.md").read_text(encoding="utf-8")
    section = document.split("## Telegram", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 2
    for block in blocks:
        settings = yaml.safe_load(block)
        config = GatewayConfig.from_dict(settings, environ={"HERMES_HOME": str(hermes_home)})
        connector = _build(config, TELEGRAM_WEBHOOK_SECRET=SECRET)
        written = settings["platforms"]["telegram"]
        assert {key: getattr(connector.settings, key) for key in written if key != "enabled"} == {
            key: value for key, value in written.items() if key != "enabled"
        }
