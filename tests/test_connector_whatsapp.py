"""The WhatsApp Cloud API connector end to end: Meta's signed webhook into a real gateway (echo
agent, SQLite under a temporary ``$HERMES_HOME``), the replies through a fake Cloud API over
HTTP on the loopback interface."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.connector_gateway import app_served, build_one, connector_serving
from support.fake_whatsapp import (
    APP_SECRET,
    ENVIRON,
    PHONE_NUMBER_ID,
    VERIFY_TOKEN,
    FakeCloudApi,
    signed_headers,
    status_body,
    text_message,
    webhook_body,
)
from support.loopback import LoopbackServer

from hermes_core import (
    ConfigError,
    EchoAgent,
    Gateway,
    GatewayConfig,
    LifecycleEvent,
    MessageEvent,
    hookimpl,
)
from hermes_core.domain.errors import StoreError
from hermes_core.gateway.texts import REFUSED_NOT_SAVED
from hermes_core.testing import fresh_plugin_manager
from hermes_core.turns.pipeline import Turn
from hermes_plugins.connectors.whatsapp import MAX_TEXT, WhatsAppConnector, cloud_failure

USER = "15551234567"


class LedgerStates:
    """An observer of the ledger's transitions (the states its rows went through)."""

    def __init__(self) -> None:
        self.states: list[str] = []

    @hookimpl
    def hermes_on_lifecycle_event(self, event: LifecycleEvent) -> None:
        if event.kind == "ledger_transition":
            self.states.append(str(event.detail["state"]))


@pytest.fixture
def api() -> Iterator[tuple[FakeCloudApi, str]]:
    fake = FakeCloudApi()
    with LoopbackServer(fake.app) as server:
        yield fake, server.url


def _config(
    home: Path, url: str, sections: dict[str, Any] | None = None, **settings: Any
) -> GatewayConfig:
    """A configuration with the connector's ``settings`` and other top-level ``sections``."""
    section = {"enabled": True, "phone_number_id": PHONE_NUMBER_ID, "api_base": url, **settings}
    data = {"gateway": {"housekeeping": {"initial_delay_secs": 3600}},
            "platforms": {"whatsapp": section}, **(sections or {})}  # fmt: skip
    return GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(home)})


def _connector(config: GatewayConfig, environ: dict[str, str] | None = None) -> WhatsAppConnector:
    """The connector ``serve`` builds for ``config``."""
    plugins = fresh_plugin_manager(config.hermes_home)
    return build_one(config, plugins, ENVIRON if environ is None else environ, WhatsAppConnector)


class Served:
    """A started connector in front of a started gateway, its route served over HTTP."""

    def __init__(
        self, connector: WhatsAppConnector, gateway: Gateway, ledger: LedgerStates, url: str
    ) -> None:
        self.connector = connector
        self.gateway = gateway
        self.ledger = ledger
        self.url = f"{url}/whatsapp"

    async def post(self, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
        """Meta's POST of ``body`` (signed unless ``headers`` say otherwise)."""
        headers = signed_headers(body) if headers is None else headers
        async with httpx.AsyncClient() as client:
            return await client.post(self.url, content=body, headers=headers)

    async def message(self, text: str, message_id: str) -> int:
        """The status of Meta's signed POST of one text message from ``USER``."""
        return (await self.post(webhook_body(text_message(USER, text, message_id)))).status_code

    async def verify(self, query: dict[str, str]) -> httpx.Response:
        """Meta's verification request."""
        async with httpx.AsyncClient() as client:
            return await client.get(self.url, params=query)


@asynccontextmanager
async def serving(
    home: Path, url: str, sections: dict[str, Any] | None = None, **settings: Any
) -> AsyncIterator[Served]:
    config = _config(home, url, sections, **settings)
    connector = _connector(config)
    ledger = LedgerStates()
    plugins = fresh_plugin_manager(home)
    plugins.register(ledger, name="ledger_states")
    async with (
        connector_serving(config, plugins, connector) as gateway,
        app_served(gateway, connector, config) as base,
    ):
        yield Served(connector, gateway, ledger, base)


async def _sent(fake: FakeCloudApi, count: int) -> list[Any]:
    return await asyncio.to_thread(fake.wait_for, count)


async def test_the_verification_handshake_answers_the_challenge_for_the_verify_token(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    async with serving(hermes_home, api[1]) as served:
        good = {"hub.mode": "subscribe", "hub.verify_token": VERIFY_TOKEN, "hub.challenge": "1158"}
        answer = await served.verify(good)
        assert (answer.status_code, answer.content) == (200, b"1158")
        assert answer.headers["content-type"].startswith("text/plain")
        for bad in ({**good, "hub.verify_token": "guess"}, {**good, "hub.mode": "unsubscribe"}):
            refused = await served.verify(bad)
            assert refused.status_code == 403
            assert VERIFY_TOKEN.encode() not in refused.content


async def test_a_signed_message_is_answered_to_the_sender_quoting_it(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    async with serving(hermes_home, url) as served:
        answer = await served.post(webhook_body(text_message(USER, "hello", "wamid.in1")))
        assert answer.status_code == 200
        await served.gateway.idle()
        (sent,) = await _sent(fake, 1)
    assert (sent.to, sent.text, sent.reply_to) == (USER, "echo: hello", "wamid.in1")
    assert "delivered" in served.ledger.states


async def test_a_status_callback_is_acknowledged_and_stores_nothing(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    async with serving(hermes_home, url) as served:
        assert (await served.post(status_body("wamid.sent1", USER))).status_code == 200
        await served.gateway.idle()
        assert served.gateway.store.list_sessions() == []
    assert fake.attempts == []


@pytest.mark.parametrize(
    "headers",
    [
        {},
        signed_headers(b"another body"),
        signed_headers(webhook_body(text_message(USER, "hi", "wamid.f")), secret="not-the-secret"),
        {"x-hub-signature-256": "sha1=0123"},
    ],
    ids=["unsigned", "other-body", "other-secret", "malformed"],
)
async def test_a_forged_or_unsigned_post_is_refused_and_stores_nothing(
    hermes_home: Path, api: tuple[FakeCloudApi, str], headers: dict[str, str]
) -> None:
    fake, url = api
    async with serving(hermes_home, url) as served:
        answer = await served.post(webhook_body(text_message(USER, "hi", "wamid.f")), headers)
        assert answer.status_code == 401
        await served.gateway.idle()
        assert served.gateway.store.list_sessions() == []
        assert APP_SECRET.encode() not in answer.content
    assert fake.attempts == []


async def test_a_body_with_two_messages_answers_both_and_a_redelivery_answers_none_again(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    other = "447700900123"
    body = webhook_body(text_message(USER, "one", "wamid.a"), text_message(other, "two", "wamid.b"))
    async with serving(hermes_home, url) as served:
        assert (await served.post(body)).status_code == 200
        await served.gateway.idle()
        await _sent(fake, 2)
        assert (await served.post(body)).status_code == 200  # Meta delivers it again
        await served.gateway.idle()
        await asyncio.sleep(0.2)
    replies = {(sent.to, sent.text, sent.reply_to) for sent in fake.attempts}
    assert replies == {(USER, "echo: one", "wamid.a"), (other, "echo: two", "wamid.b")}
    assert len(fake.attempts) == 2


async def test_a_long_reply_is_split_and_only_its_first_part_quotes(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    text = "\n\n".join(f"paragraph {n} " + "x" * 900 for n in range(6))
    async with serving(hermes_home, url) as served:
        assert (
            await served.post(webhook_body(text_message(USER, text, "wamid.long")))
        ).status_code == 200
        await served.gateway.idle()
        parts = await _sent(fake, 2)
    assert all(len(part.text) <= MAX_TEXT for part in parts)
    assert "\n\n".join(part.text for part in parts) == f"echo: {text}"
    assert [part.reply_to for part in parts] == ["wamid.long", None]


async def test_a_rate_limited_reply_is_sent_again(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    fake.fail_next(130429)
    async with serving(hermes_home, url, rate_limit_wait_secs=0.2) as served:
        assert (
            await served.post(webhook_body(text_message(USER, "hi", "wamid.r")))
        ).status_code == 200
        (sent,) = await _sent(fake, 1)
        await served.gateway.idle()
    assert [attempt.accepted for attempt in fake.attempts] == [False, True]
    assert sent.text.endswith("\n\necho: hi")  # the gateway's recovered-reply prefix above it
    assert (sent.to, sent.reply_to) == (USER, "wamid.r")


async def test_a_reply_outside_the_24_hour_window_is_abandoned(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    fake.fail_next(131047)
    async with serving(hermes_home, url, rate_limit_wait_secs=0.1) as served:
        assert (
            await served.post(webhook_body(text_message(USER, "hi", "wamid.w")))
        ).status_code == 200
        await served.gateway.idle()
        await asyncio.sleep(0.5)
    assert len(fake.attempts) == 1
    assert not fake.attempts[0].accepted
    assert served.ledger.states[-1] == "abandoned"


async def test_a_message_the_store_cannot_take_gets_a_5xx_and_is_answered_when_sent_again(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    body = webhook_body(text_message(USER, "hi", "wamid.s"))
    quick = {"storage": {"sqlite_busy_timeout_secs": 0.3}}
    async with serving(hermes_home, url, quick) as served:
        holder = sqlite3.connect(hermes_home / "state.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            assert (await served.post(body)).status_code == 503
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert (await served.post(body)).status_code == 200  # Meta delivers it again
        await served.gateway.idle()
        await _sent(fake, 2)
    assert fake.texts() == [REFUSED_NOT_SAVED, "echo: hi"]


async def test_a_batch_whose_second_message_is_not_stored_is_answered_once_when_sent_again(
    hermes_home: Path, api: tuple[FakeCloudApi, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = api
    other = "447700900123"
    body = webhook_body(text_message(USER, "one", "wamid.a"), text_message(other, "two", "wamid.b"))
    async with serving(hermes_home, url) as served:
        pipeline = served.gateway.pipeline
        assert pipeline is not None
        begin = pipeline.begin

        def broken(key: str, event: MessageEvent, consumed: int | None = None) -> Turn | None:
            if event.text == "two":
                raise StoreError("disk full")
            return begin(key, event, consumed)

        monkeypatch.setattr(pipeline, "begin", broken)
        assert (await served.post(body)).status_code == 503  # the first was stored, not the second
        monkeypatch.setattr(pipeline, "begin", begin)
        assert (await served.post(body)).status_code == 200  # Meta delivers the whole body again
        await served.gateway.idle()
        await _sent(fake, 3)
        await asyncio.sleep(0.2)
    replies = sorted((sent.to, sent.text) for sent in fake.attempts)
    assert replies == sorted(
        [(USER, "echo: one"), (other, REFUSED_NOT_SAVED), (other, "echo: two")]
    )


def test_meta_error_codes_become_failure_kinds() -> None:
    def kind(status: int, code: int | None) -> str | None:
        answer = {"error": {"code": code, "message": "m"}} if code is not None else {}
        return cloud_failure(status, answer).failure_kind

    assert [kind(400, code) for code in (4, 80007, 130429, 131048, 131056)] == ["rate_limited"] * 5
    assert [kind(400, code) for code in (131047, 131026, 190, 10, 200, 368)] == ["permanent"] * 6
    assert [kind(500, 1), kind(503, 131000), kind(400, 131016), kind(502, None)] == [
        "disconnected"
    ] * 4
    assert [kind(400, 100), kind(400, 131009), kind(400, None)] == ["rejected"] * 3
    assert kind(429, None) == "rate_limited"
    window = cloud_failure(400, {"error": {"code": 131047, "message": "Re-engagement message"}})
    assert "24 hours" in (window.error or "")


async def test_a_refused_access_token_is_a_config_error_at_start(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    connector = _connector(
        _config(hermes_home, api[1]), {**ENVIRON, "WHATSAPP_ACCESS_TOKEN": "expired"}
    )
    config = _config(hermes_home, api[1])
    gateway = Gateway(config, fresh_plugin_manager(hermes_home), lambda e: EchoAgent(), [])
    with pytest.raises(ConfigError, match="refused the access token in WHATSAPP_ACCESS_TOKEN"):
        await connector.start(gateway)
    assert not connector.is_connected()


async def test_an_api_outage_at_start_is_no_error_and_sends_wait_for_it(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    fake, url = api
    fake.down = True
    async with serving(hermes_home, url, rate_limit_wait_secs=0.1) as served:
        assert served.connector.is_connected()
        assert served.connector.status().endswith(f"{PHONE_NUMBER_ID} via {url}")
        assert await served.message("hi", "wamid.o") == 200
        await served.gateway.idle()
        source = served.gateway.store.list_sessions()[0].origin
        assert source is not None
        result = await served.connector.send(source, "direct", reply_to="wamid.o")
    assert (result.ok, result.failure_kind) == (False, "disconnected")
    assert fake.attempts == []


def test_missing_settings_and_secrets_name_what_to_set(hermes_home: Path) -> None:
    config = _config(hermes_home, "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="WHATSAPP_APP_SECRET, which is not set"):
        _connector(config, {k: v for k, v in ENVIRON.items() if k != "WHATSAPP_APP_SECRET"})
    data = {"platforms": {"whatsapp": {"enabled": True}}}
    unset = GatewayConfig.from_dict(data, environ={"HERMES_HOME": str(hermes_home)})
    with pytest.raises(ConfigError, match=r"platforms\.whatsapp\.phone_number_id"):
        _connector(unset)


async def test_status_names_the_route_and_the_number(
    hermes_home: Path, api: tuple[FakeCloudApi, str]
) -> None:
    async with serving(hermes_home, api[1]) as served:
        status = served.connector.status()
    assert status.startswith("whatsapp: webhook /whatsapp")
    assert PHONE_NUMBER_ID in status
    assert "+15550783881" in status
    assert all(secret not in status for secret in ENVIRON.values())
