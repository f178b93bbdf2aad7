"""The connector seam: registering connectors, their conflicts, a connector's settings and
secrets read with named errors, and owed replies sent with the lane's whole origin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from hermes_core import (
    ConfigError,
    ConnectorContext,
    ConnectorSpec,
    EchoAgent,
    Gateway,
    GatewayConfig,
    PluginConflictError,
    SendResult,
    SessionSource,
    SessionStore,
    create_plugin_manager,
    hookimpl,
)
from hermes_core.domain.connectors import WebResponse


class _Connectors:
    def __init__(self, *platforms: str) -> None:
        self.specs = [ConnectorSpec(platform=name, build=lambda c: c) for name in platforms]

    @hookimpl
    def hermes_register_connectors(self, config: GatewayConfig) -> list[ConnectorSpec]:
        return self.specs


def _config(home: Path, data: dict[str, Any] | None = None) -> GatewayConfig:
    return GatewayConfig.from_dict(data or {}, environ={"HERMES_HOME": str(home)})


def test_a_connector_registers_and_two_for_one_platform_conflict(hermes_home: Path) -> None:
    manager = create_plugin_manager(_config(hermes_home), load_entrypoints=False)
    manager.register(_Connectors("irc"), name="irc_plugin")
    assert "irc" in manager.connectors()
    assert "irc" in manager.list_plugins()[-1].provides.connectors
    manager.register(_Connectors("irc"), name="other")
    with pytest.raises(PluginConflictError, match="connector for platform 'irc' is registered"):
        manager.connectors()


class _Settings(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    mode: str = Field("polling", pattern="^(polling|webhook)$", description="polling or webhook")
    token_env: str = "IRC_TOKEN"


def _context(home: Path, section: dict[str, Any], **environ: str) -> ConnectorContext:
    config = _config(home, {"platforms": {"irc": {"enabled": True, **section}}})
    return ConnectorContext(
        platform="irc", settings=config.platforms["irc"].model_extra or {}, config=config,
        environ=environ, read_event=lambda payload: None,
    )  # fmt: skip


def test_a_connector_reads_its_keys_and_the_host_keeps_its_own(hermes_home: Path) -> None:
    context = _context(hermes_home, {"mode": "webhook", "host_setting": 3})
    assert context.settings_as(_Settings).mode == "webhook"
    assert context.settings["host_setting"] == 3


def test_a_bad_connector_setting_names_the_key(hermes_home: Path) -> None:
    context = _context(hermes_home, {"mode": "carrier-pigeon"})
    with pytest.raises(ConfigError, match=r"platforms\.irc\.mode.*polling or webhook") as caught:
        context.settings_as(_Settings)
    assert caught.value.key == "platforms.irc.mode"


def test_a_secret_comes_from_the_variable_the_section_names(hermes_home: Path) -> None:
    context = _context(hermes_home, {}, IRC_TOKEN=" s3cret ")
    assert context.secret("IRC_TOKEN", "token_env") == "s3cret"
    with pytest.raises(ConfigError, match="IRC_OTHER, which is not set") as caught:
        context.secret("IRC_OTHER", "token_env")
    assert "s3cret" not in str(caught.value)
    assert caught.value.key == "platforms.irc.token_env"


def test_a_web_response_carries_json_and_text() -> None:
    assert WebResponse.json(200, {"ok": True}).body == b'{"ok": true}'
    assert WebResponse.text(401, "no").status == 401


class _Recorder:
    """An adapter that keeps the source each reply was sent to."""

    platform = "slack"

    def __init__(self) -> None:
        self.sources: list[tuple[SessionSource, str, str | None]] = []

    def is_connected(self) -> bool:
        return True

    async def send(
        self, source: SessionSource, text: str, *, reply_to: str | None = None
    ) -> SendResult:
        self.sources.append((source, text, reply_to))
        return SendResult(ok=True)


async def test_an_owed_reply_sent_at_start_goes_to_the_lanes_origin(hermes_home: Path) -> None:
    """After a restart no turn carries the reply's source: the lane's stored origin does, with
    the chat type and the workspace a connector may need to send it."""
    config = _config(hermes_home)
    origin = SessionSource(
        platform="slack", chat_id="D024BE91L", chat_type="dm", user_id="U2147483697",
        scope_id="T061EG9R6",
    )  # fmt: skip
    with SessionStore(config.sessions_dir, config) as store:
        entry = store.get_or_create_session(origin)
        store._turns.record_delivery_obligation(
            entry.session_key, entry.session_id, "slack", "D024BE91L", None, "owed", "m1",
            reply_to_message_id="1700000000.000100",
        )  # fmt: skip
    adapter = _Recorder()
    async with Gateway(config, None, lambda entry: EchoAgent(), [adapter]) as gateway:
        await gateway.idle()
    ((source, text, reply_to),) = adapter.sources
    assert (source.chat_type, source.user_id, source.scope_id) == ("dm", "U2147483697", "T061EG9R6")
    assert (source.chat_id, text, reply_to) == ("D024BE91L", "owed", "1700000000.000100")
