"""The example third-party plugin's IRC connector (examples/hermes-irc), installed as a
distribution and built through the plugin manager as ``hermes-sessions serve`` builds it, against
a fake IRC server on the loopback interface and a real Gateway (SQLite under the test's home, the
echo agent): channel messages and private messages answered where they came from, long replies
cut into lines under the limit, PING answered, a dropped connection re-established."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.connector_gateway import LongAgent, connector_serving, until
from support.fake_irc import FakeIrc

from conftest import FakeDistribution
from hermes_core import (
    Agent,
    ConfigError,
    Connector,
    EchoAgent,
    Gateway,
    GatewayConfig,
    MessageEvent,
    MessageNotStoredError,
    SessionSource,
    create_plugin_manager,
)
from hermes_core.serve.runner import build_connectors

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hermes-irc"
NICK = "hermesbot"


@pytest.fixture
async def fake(fake_distribution: FakeDistribution) -> AsyncIterator[tuple[FakeIrc, int]]:
    """The example installed as the distribution hermes-irc, and a fake server with its port."""
    fake_distribution(
        "hermes-irc", version="0.1.0", entry_points={"irc": "hermes_irc"},
        extra_path=EXAMPLE / "src",
    )  # fmt: skip
    server = FakeIrc(password="letmein")
    port = await server.start()
    yield server, port
    await server.close()


def _config(home: Path, port: int, /, drop: str = "", **section: Any) -> GatewayConfig:
    """A configuration enabling ``platforms.irc`` for the fake (its setting ``drop`` left out)."""
    settings = {
        "enabled": True, "server": "127.0.0.1", "port": port, "nick": NICK,
        "channels": ["#hermes", "#python"], "network": "libera", "password_env": "IRC_PASSWORD",
        "line_delay_secs": 0, "retry_max_secs": 0.2, **section,
    }  # fmt: skip
    settings.pop(drop, None)
    return GatewayConfig.from_dict(
        {"platforms": {"irc": settings}}, environ={"HERMES_HOME": str(home)}
    )


def _build(config: GatewayConfig, environ: Mapping[str, str] | None = None) -> Connector:
    """The connector as ``serve`` builds it: through the plugin manager's registered spec."""
    plugins = create_plugin_manager(config, strict=True)
    assert plugins.connectors()["irc"].summary.startswith("IRC: ")
    given = {"IRC_PASSWORD": "letmein"} if environ is None else environ
    [connector] = build_connectors(config, plugins, given)
    return connector


def serving(
    config: GatewayConfig, connector: Connector, agent: Agent | None = None
) -> AbstractAsyncContextManager[Gateway]:
    """A started gateway with the connector started into it (one ``agent`` for every session,
    else the echo agent)."""
    factory = EchoAgent if agent is None else lambda: agent
    return connector_serving(config, create_plugin_manager(config, strict=True), connector, factory)


def _privmsgs(server: FakeIrc, target: str) -> list[str]:
    """The texts the client sent to ``target``."""
    head = f"PRIVMSG {target} :"
    return [line[len(head) :] for line in server.received if line.startswith(head)]


async def test_a_channel_message_is_answered_in_the_channel(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    config = _config(hermes_home, port)
    connector = _build(config)
    assert not connector.adapter.is_connected()
    async with serving(config, connector) as gateway:
        assert connector.adapter.is_connected()
        assert connector.status() == f"irc: 127.0.0.1:{port} as {NICK} in #hermes, #python"
        await until(lambda: bool(server.lines("JOIN")))
        server.say("Alice", "#hermes", "hello channel")
        await until(lambda: bool(_privmsgs(server, "#hermes")))
        [session] = gateway.store.list_sessions()
    assert server.received[:3] == [
        "PASS :letmein",
        f"NICK {NICK}",
        f"USER {NICK} 0 * :hermes-sessions",
    ]
    assert server.lines("JOIN") == ["JOIN #hermes,#python"]
    [reply] = _privmsgs(server, "#hermes")
    assert reply.startswith("echo: ")
    assert reply.endswith("hello channel")
    assert session.session_key == "agent:main:irc:group:s=libera:c=#hermes:u=alice"
    assert server.received[-1].startswith("QUIT")


async def test_a_private_message_is_answered_to_the_sender(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    config = _config(hermes_home, port)
    connector = _build(config)
    async with serving(config, connector):
        server.say("Bob[m]", NICK, "hello bot")
        await until(lambda: bool(_privmsgs(server, "Bob[m]")))
    assert _privmsgs(server, "Bob[m]") == ["echo: hello bot"]
    assert _privmsgs(server, "#hermes") == []


async def test_a_long_reply_is_cut_into_lines_under_the_limit(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    paragraph = " ".join(f"Wörter{n} ünd 😀" for n in range(200))
    agent = LongAgent(f"{paragraph}\n\nsecond line\r\nthird line")
    config = _config(hermes_home, port)
    connector = _build(config)
    async with serving(config, connector, agent):
        server.say("Alice", "#hermes", "talk a lot")
        await until(lambda: "third line" in _privmsgs(server, "#hermes"))
    lines = [line for line in server.received if line.startswith("PRIVMSG #hermes :")]
    assert all(len(line.encode("utf-8")) <= 400 for line in lines)
    texts = _privmsgs(server, "#hermes")
    assert len(texts) > 3
    assert texts[-2:] == ["second line", "third line"]
    assert " ".join(texts[:-2]).split() == paragraph.split()


async def test_ping_is_answered_with_pong(fake: tuple[FakeIrc, int], hermes_home: Path) -> None:
    server, port = fake
    config = _config(hermes_home, port)
    connector = _build(config)
    async with serving(config, connector):
        server.ping("fake.server 12345")
        await until(lambda: bool(server.lines("PONG")))
    assert server.lines("PONG") == ["PONG :fake.server 12345"]


async def test_a_dropped_connection_is_re_established_and_the_channels_joined_again(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    config = _config(hermes_home, port)
    connector = _build(config)
    async with serving(config, connector):
        await until(lambda: len(server.lines("JOIN")) == 1)
        server.drop()
        await until(lambda: server.connections == 2 and len(server.lines("JOIN")) == 2)
        await until(connector.adapter.is_connected)
        server.say("Alice", "#python", "after the drop")
        await until(lambda: bool(_privmsgs(server, "#python")))
    assert server.lines("JOIN") == ["JOIN #hermes,#python"] * 2
    assert _privmsgs(server, "#python")[0].endswith("after the drop")
    assert not connector.adapter.is_connected()


async def test_a_server_unreachable_at_start_is_tried_again(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    with socket.socket() as probe:  # a port nothing listens on, until the test starts a server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = _config(hermes_home, port)
    connector = _build(config)
    server = FakeIrc(password="letmein")
    async with serving(config, connector):
        assert not connector.adapter.is_connected()
        assert "(cannot connect (" in connector.status()
        await server.start(port)
        try:
            await until(connector.adapter.is_connected)
            await until(lambda: bool(server.lines("JOIN")))
            assert connector.status() == f"irc: 127.0.0.1:{port} as {NICK} in #hermes, #python"
        finally:
            await server.close()


async def test_a_reply_while_disconnected_is_reported_disconnected(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    _, port = fake
    connector = _build(_config(hermes_home, port))
    source = SessionSource(platform="irc", chat_id="#hermes", chat_type="group", scope_id="x")
    result = await connector.adapter.send(source, "nobody hears this")
    assert (result.ok, result.failure_kind) == (False, "disconnected")


async def test_a_taken_nickname_gets_an_underscore(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    server.taken.add(NICK)
    config = _config(hermes_home, port)
    connector = _build(config)
    async with serving(config, connector):
        assert connector.status().startswith(f"irc: 127.0.0.1:{port} as {NICK}_ in #hermes")
        server.say("Alice", f"{NICK}_", "are you there")
        await until(lambda: bool(_privmsgs(server, "Alice")))


async def test_a_refused_password_is_a_config_error_at_start(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    _, port = fake
    config = _config(hermes_home, port)
    connector = _build(config, {"IRC_PASSWORD": "wrong"})
    with pytest.raises(ConfigError, match=r"refused .*464.*fix platforms\.irc\.password_env"):
        async with serving(config, connector):
            pass


class RefusingInbox:
    """An inbox whose store is unavailable."""

    def __init__(self) -> None:
        self.offered: list[MessageEvent] = []

    async def handle_message(self, event: MessageEvent) -> None:
        self.offered.append(event)
        raise MessageNotStoredError("the store is unavailable")

    async def platform_connected(self, platform: str) -> None:
        return None


async def test_a_message_not_stored_is_reported_to_its_sender(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    server, port = fake
    connector = _build(_config(hermes_home, port))
    inbox = RefusingInbox()
    await connector.start(inbox)
    try:
        server.say("Alice", "#hermes", "will this be kept?")
        await until(lambda: bool(server.lines("NOTICE")))
    finally:
        await connector.stop()
    [event] = inbox.offered
    assert (event.source.chat_id, event.source.user_id, event.text) == (
        "#hermes", "Alice", "will this be kept?"
    )  # fmt: skip
    [notice] = server.lines("NOTICE")
    assert notice.startswith("NOTICE Alice :your message was not stored")
    assert _privmsgs(server, "#hermes") == []


@pytest.mark.parametrize(
    ("change", "key", "says"),
    [
        ({"drop": "nick"}, "nick", "is missing"),
        ({"nick": "9lives"}, "nick", "expected a nickname"),
        ({"port": 70000}, "port", "expected a TCP port"),
        ({"drop": "server"}, "server", "is missing"),
        ({"channels": ["hermes"]}, "channels", "expected a list of channel names"),
        ({"network": ""}, "network", "expected the network's name"),
        ({"tls": "maybe"}, "tls", "expected true"),
    ],
)
async def test_settings_errors_name_the_key(
    fake: tuple[FakeIrc, int], hermes_home: Path, change: dict[str, Any], key: str, says: str
) -> None:
    _, port = fake
    with pytest.raises(ConfigError, match=rf"platforms\.irc\.{key}\b.*{says}"):
        _build(_config(hermes_home, port, **change))


async def test_an_unset_password_variable_is_named(
    fake: tuple[FakeIrc, int], hermes_home: Path
) -> None:
    _, port = fake
    with pytest.raises(ConfigError, match=r"platforms\.irc\.password_env names .*IRC_PASSWORD"):
        _build(_config(hermes_home, port), {})


def test_the_readme_configuration_is_valid(
    hermes_home: Path, fake_distribution: FakeDistribution
) -> None:
    fake_distribution(
        "hermes-irc", version="0.1.0", entry_points={"irc": "hermes_irc"},
        extra_path=EXAMPLE / "src",
    )  # fmt: skip
    readme = (EXAMPLE / "README.md").read_text(encoding="utf-8")
    [block] = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    config = GatewayConfig.from_dict(
        yaml.safe_load(block), environ={"HERMES_HOME": str(hermes_home)}
    )
    connector = _build(config, {"IRC_PASSWORD": "secret"})
    assert connector.status().startswith("irc: irc.libera.chat:6697 as ")
