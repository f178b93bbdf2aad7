"""Agents from configuration: ``agent.use`` by entry point name or import string, ``agent.options``
for a builder, the ``--agent`` flag winning, and a named error for each thing a user gets wrong."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from support.agents import Greeter, LaneAgent

from hermes_core import EchoAgent, GatewayConfig, SessionEntry
from hermes_core.domain.errors import ConfigError, InvalidValueError
from hermes_core.gateway.agent_loading import LoadedAgent, load_agent
from hermes_core.testing import telegram_dm

ROOT = Path(__file__).resolve().parents[1]


def _config(agent: dict[str, Any]) -> GatewayConfig:
    return GatewayConfig.from_dict({"agent": agent}, source="config.yaml")


def _entry() -> SessionEntry:
    now = datetime.now(timezone.utc)
    return SessionEntry(
        session_key="agent:main:telegram:dm:c=5", session_id="20260102_030405_abcdef01",
        created_at=now, updated_at=now, origin=telegram_dm("5"),
    )  # fmt: skip


def _refused(config: GatewayConfig, override: str | None = None) -> InvalidValueError:
    with pytest.raises(InvalidValueError) as caught:
        load_agent(config, override)
    return caught.value


def test_the_default_is_the_echo_entry_point() -> None:
    loaded = load_agent(GatewayConfig.from_dict({}))
    assert loaded.name == "echo"
    assert isinstance(loaded.factory(_entry()), EchoAgent)


def test_an_import_string_names_a_factory_called_with_the_lane_entry() -> None:
    loaded = load_agent(_config({"use": "support.agents:LaneAgent"}))
    agent = loaded.factory(_entry())
    assert isinstance(agent, LaneAgent)
    assert agent.entry.session_key == "agent:main:telegram:dm:c=5"


def test_an_import_string_names_a_builder_given_the_options() -> None:
    config = _config({"use": "support.agents:greeters", "options": {"greeting": "ahoy"}})
    agent = load_agent(config).factory(_entry())
    assert isinstance(agent, Greeter)
    assert agent.greeting == "ahoy"


async def test_the_flag_wins_and_the_configured_options_stay_with_the_configured_agent() -> None:
    config = _config({"use": "support.agents:greeters", "options": {"greeting": "ahoy"}})
    assert isinstance(load_agent(config, "echo").factory(_entry()), EchoAgent)  # no options
    assert isinstance(load_agent(config, "support.agents:LaneAgent").factory(_entry()), LaneAgent)
    same = load_agent(config, "support.agents:greeters").factory(_entry())
    assert isinstance(same, Greeter)
    assert same.greeting == "ahoy"
    other = _config({"use": "support.agents:LaneAgent"})
    flagged = load_agent(other, "support.agents:greeters").factory(_entry())
    assert isinstance(flagged, Greeter)
    assert flagged.greeting == "hello"  # the builder's default: the options were not its own
    await LoadedAgent("echo", lambda entry: EchoAgent()).aclose()  # nothing to close: no error


def test_a_third_party_distribution_registers_an_agent_by_name(
    fake_distribution: Callable[..., Path],
) -> None:
    fake_distribution(
        "hermes-parrot", group="hermes.agents", entry_points={"parrot": "parrot:build"},
        modules={"parrot": """
            from support.agents import Greeter

            def build(options, config):
                return lambda entry: Greeter(options["word"])
        """},
    )  # fmt: skip
    agent = load_agent(_config({"use": "parrot", "options": {"word": "squawk"}})).factory(_entry())
    assert isinstance(agent, Greeter)
    assert agent.greeting == "squawk"


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("no such!", "not an agent name; write an entry point name such as echo or openai"),
        ("parrot", "no agent of that name in the entry point group hermes.agents (installed: "
         "echo, openai)"),
        ("support.nowhere:X", "importing 'support.nowhere' failed"),
        ("support.agents:Missing", "'support.agents' has no attribute 'Missing'; name a class"),
        ("support.agents:no_entry", "takes 0 required arguments; name an agent factory taking"),
        ("support.agents:two_entries", "takes 3 required arguments"),
        ("support.agents:__doc__", "names a str, not something to call"),
        ("support.agents:broken_builder", "is a builder that returned a NoneType; a builder"),
    ],
)  # fmt: skip
def test_a_bad_name_is_a_named_error_saying_what_to_change(spec: str, problem: str) -> None:
    flagged = _refused(GatewayConfig.from_dict({}), spec)
    assert type(flagged) is InvalidValueError
    assert flagged.field == "agent"
    assert str(flagged).startswith(f"--agent {spec!r}: {problem}")
    if spec == "no such!":  # the configuration refuses the form itself
        with pytest.raises(ConfigError, match=r"invalid value for agent\.use: 'no such!'"):
            _config({"use": spec})
        return
    configured = _refused(_config({"use": spec}))
    assert isinstance(configured, ConfigError)
    assert configured.key == "agent.use"
    assert str(configured).startswith(f"config.yaml: agent.use {spec!r}: {problem}")


def test_options_for_an_agent_that_takes_none_are_refused() -> None:
    error = _refused(_config({"use": "support.agents:LaneAgent", "options": {"x": 1}}))
    assert "is an agent factory, which takes no options; remove agent.options" in str(error)
    error = _refused(_config({"use": "echo", "options": {"delay": 1}}))
    assert isinstance(error, ConfigError)
    assert error.key == "agent.options.delay"
    assert str(error).startswith("config.yaml: unknown key agent.options.delay")


def test_the_options_section_is_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"invalid value for agent\.options"):
        _config({"options": ["model"]})
    assert _config({"options": None}).agent.options == {}


def test_importing_the_core_and_the_loader_imports_no_http_library() -> None:
    code = (
        "import sys, hermes_core, hermes_core.gateway.agent_loading, hermes_core.cli.console\n"
        "from hermes_core import GatewayConfig\n"
        "from hermes_core.gateway.agent_loading import load_agent\n"
        "load_agent(GatewayConfig.from_dict({}))\n"
        "print(sorted(m for m in ('httpx', 'starlette', 'uvicorn') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=True)  # fmt: skip
    assert done.stdout == "[]\n"
